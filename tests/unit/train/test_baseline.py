"""The sweep's baseline (the untrained student's evaluation) is computed once even when trials start together."""

import threading
import time

from kdsweep.distributed import single_process
from kdsweep.train.baseline import baseline
from kdsweep.train.step import EvalResult


def test_trials_that_start_together_evaluate_the_baseline_once(tmp_path):
    path = tmp_path / "sweep" / "baselines" / "key.json"
    calls, results = [], []

    def evaluate() -> EvalResult:
        calls.append(1)
        time.sleep(0.3)  # long enough for the other trial to arrive while this one evaluates
        return EvalResult(student_ce=4.5, teacher_ce=4.0, kl=0.5, tokens=100)

    trials = [threading.Thread(target=lambda: results.append(baseline(path, evaluate, single_process())))
              for _ in range(3)]
    for t in trials:
        t.start()
    for t in trials:
        t.join()
    assert len(calls) == 1 and sorted(reused for _, reused in results) == [False, True, True]
    assert {r.student_ce for r, _ in results} == {4.5}
    assert baseline(None, evaluate, single_process())[1] is False and len(calls) == 2  # a plain run evaluates
