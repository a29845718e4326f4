"""The controller's bookkeeping on real Optuna storages: resume, orphans, judging, the status table."""

import json
import os

import optuna
import pytest

from kdsweep.config import ConfigError
from kdsweep.sweep.controller import Controller, LocalProcesses, summary_lines
from kdsweep.sweep.judge import Outcome, judge
from kdsweep.sweep.manifest import STORAGE_ENV, Manifest
from kdsweep.sweep.space import parse_space
from kdsweep.sweep.study import SweepSettings

SPACE = {"kd_ratio": "interval(0.0,1.0)", "lora_rank": "choice(4,8,16)"}


@pytest.fixture(autouse=True)
def own_storage_env():
    """A controller puts its storage's URL in this process's environment, for the jobs it starts: undone after each
    test, so that no later test's jobs (a dashboard, a sweep) read this test's storage."""
    before = os.environ.get(STORAGE_ENV)
    yield
    os.environ.pop(STORAGE_ENV, None)
    if before is not None:
        os.environ[STORAGE_ENV] = before


def controller(tmp_path, **settings):
    s = SweepSettings(**{"study_name": "c", "sampler": "random", "seed": 0, "pruner": "none", **settings})
    return Controller(s, parse_space(SPACE), ["train=smoke"], tmp_path, LocalProcesses(1))


def test_a_resumed_sweep_does_not_propose_its_old_points_again(tmp_path):
    first = controller(tmp_path)
    old = []
    for _ in range(3):
        trial = first.study.ask(first.distributions)
        first.manifest.put(trial.number, params=trial.params, state="COMPLETE", values=[1.0], run_dir=str(tmp_path))
        old.append(trial.params)
    again = controller(tmp_path)  # the same command, same seed, after the controller died
    new = [again.study.ask(again.distributions).params for _ in range(3)]
    assert not any(p in old for p in new)


def test_a_trial_asked_but_never_saved_starts_on_resume_with_its_number_and_point(tmp_path):
    first = controller(tmp_path)
    lost = first.study.ask(first.distributions)  # the controller died right after ask: no job ran
    again = controller(tmp_path)
    entry = again.manifest.trial(lost.number)
    assert entry["state"] == "ASKED" and entry["params"] == lost.params  # run() starts ASKED trials first
    assert f"trial.number={lost.number}" in entry["args"]
    assert again.study.trials[lost.number].state == optuna.trial.TrialState.RUNNING


def test_a_trial_cut_short_inside_ask_gets_the_rest_of_its_point_on_resume(tmp_path):
    first = controller(tmp_path)
    half = first.study.ask()  # created, but the controller died while it sampled its point
    kd_ratio = half.suggest_float("kd_ratio", 0.0, 1.0)
    again = controller(tmp_path)
    entry = again.manifest.trial(half.number)
    assert entry["state"] == "ASKED" and entry["params"]["kd_ratio"] == kd_ratio and entry["params"]["lora_rank"] in (4, 8, 16)
    assert again.study.trials[half.number].params == entry["params"]


@pytest.mark.parametrize("change", [{"pruner": "median"}, {"seed": 1}, {"objectives": ("kl",)}])
def test_resume_refuses_settings_every_process_must_share(tmp_path, change):
    controller(tmp_path)
    with pytest.raises(ConfigError, match="holds a sweep with other settings"):
        controller(tmp_path, **change)
    controller(tmp_path, n_trials=20, max_concurrent=4)  # budget and concurrency may change


def test_an_unreachable_storage_leaves_no_sweep_behind(tmp_path):
    with pytest.raises(ConfigError, match="cannot be reached"):
        controller(tmp_path / "sweep", storage="sqlite:////no/such/dir/x.db")
    assert not (tmp_path / "sweep" / "sweep.json").exists()


def test_judge(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"status": "running"}))
    assert judge(tmp_path, "CANCELLED", ("student_ce",), 1, 3).state == "FAIL"  # scancel: not retried
    assert judge(tmp_path, "TIMEOUT", ("student_ce",), 1, 3).state == "RETRY"
    assert judge(tmp_path, -9, ("student_ce",), 4, 3).state == "FAIL"  # retries are bounded
    (tmp_path / "run.json").write_text(json.dumps({"status": "completed", "eval_after": {"student_ce": float("nan")}}))
    assert "not finite" in judge(tmp_path, 0, ("student_ce",), 1, 3).reason


def test_a_rank_s_own_error_fails_the_trial_and_a_rank_lost_from_outside_is_retried(tmp_path):
    """The records the ranks write (kdsweep.distributed.failure.record): rank 1 raising its own RuntimeError leaves an
    own record beside rank 0's lost peer; rank 1 killed (kill -9, the OOM killer) leaves only rank 0's."""
    from kdsweep.distributed import failure
    from kdsweep.distributed.comm import CollectiveRefused

    (tmp_path / "run.json").write_text(json.dumps({"status": "interrupted"}))
    failure.record(tmp_path, 0, CollectiveRefused("a peer is gone"))
    retried = judge(tmp_path, 1, ("student_ce",), 1, 1)
    assert retried.state == "RETRY" and "rank 0 (" in retried.reason and "lost a peer" in retried.reason
    failure.doing("training step 6")
    failure.record(tmp_path, 1, RuntimeError("CUDA out of memory"))
    failed = judge(tmp_path, 1, ("student_ce",), 1, 1)
    assert failed.state == "FAIL" and failed.reason.startswith("rank 1 (") and "failed while training step 6: " \
        "RuntimeError: CUDA out of memory; lower data.micro_batch_size" in failed.reason
    assert judge(tmp_path, -9, ("student_ce",), 1, 1).state == "FAIL"  # however the job ended
    (tmp_path / "run.json").write_text(json.dumps({"status": "preempted"}))
    assert judge(tmp_path, "PREEMPTED", ("student_ce",), 1, 1).state == "RETRY"  # preempted: the cluster's doing


def test_status_marks_the_best_trial_by_direction_and_the_pareto_front(tmp_path):
    def table(directions, values):
        s = SweepSettings(study_name="t", objectives=("student_ce", "kl")[:len(directions)], directions=directions)
        (tmp_path / "_".join(directions)).mkdir()
        m = Manifest.open(tmp_path / "_".join(directions), s, [], [])
        for n, v in enumerate(values):
            m.put(n, state="COMPLETE", values=v, params={}, run_dir="d")
        return [line.endswith(("<- best", "<- pareto")) for line in summary_lines(m)[1:]]

    assert table(("minimize",), [[2.0], [1.0], [3.0]]) == [False, True, False]
    assert table(("maximize",), [[2.0], [1.0], [3.0]]) == [False, False, True]
    assert table(("minimize", "minimize"), [[1.0, 3.0], [2.0, 2.0], [3.0, 3.0]]) == [True, True, False]


def test_the_summary_names_every_kind_of_job_even_one_adopted_with_only_its_logs(tmp_path):
    """A trial whose job ended while no controller watched (kill -9 in the launch window, then resume: its
    run.json was found) keeps only its logs: the summary says so, it does not die on a missing pid."""
    s = SweepSettings(study_name="t", objectives=("student_ce",), directions=("minimize",))
    m = Manifest.open(tmp_path, s, [], [])
    jobs = [{"pid": 12, "logs": []}, {"slurm_job_id": "7", "logs": []}, {"worker": "w0", "seq": 1, "logs": []},
            {"unwatched": True, "logs": ["job.log"]}, None]
    for n, job in enumerate(jobs):
        m.put(n, state="COMPLETE", values=[1.0 + n], params={}, run_dir="d", job=job)
    lines = summary_lines(m)[1:]
    for line, name in zip(lines, ["pid 12", "slurm 7", "worker w0", "ended unwatched", " - "]):
        assert name in line, (name, line)


def test_range_mistakes_and_grid_over_a_range():
    with pytest.raises(ConfigError, match="range\\(\\) takes integers"):
        parse_space({"lr": "range(0.001,0.01,0.003)"})
    with pytest.raises(ConfigError, match="range\\(\\) takes integers"):
        parse_space({"train.max_steps": "range(100,20,-20)"})
    (p,) = parse_space({"train.max_steps": "range(20,100,20)"})
    assert p.values() == [20, 40, 60, 80]


def test_concurrent_trials_share_the_cores_and_a_trial_alone_gets_them_all_unless_the_user_chose(monkeypatch):
    """The test session sets OMP_NUM_THREADS (tests/conftest.py), so the jobs the integration tests start take the
    user's-choice branch; this is the default one."""
    from kdsweep.metrics.records import SHARED_THREADS
    from kdsweep.sweep.workers import LocalStarter

    cores = len(os.sched_getaffinity(0))
    share = str(max(1, cores // 2))
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv(STORAGE_ENV, "sqlite:///study.db")
    trials = LocalProcesses(max_concurrent=2)
    assert trials.env()["OMP_NUM_THREADS"] == share and SHARED_THREADS not in trials.env()
    alone = trials.env(alone=True)  # the teacher pass on every core, then the trial on its share
    assert (alone["OMP_NUM_THREADS"], alone[SHARED_THREADS], alone[STORAGE_ENV]) == (str(cores), share, "sqlite:///study.db")
    workers = LocalStarter(size=2)
    assert (workers.threads, workers.all_cores, workers._env["OMP_NUM_THREADS"]) == (int(share), cores, share)

    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice holds, alone or not
    trials = LocalProcesses(max_concurrent=2)
    assert trials.env()["OMP_NUM_THREADS"] == trials.env(alone=True)["OMP_NUM_THREADS"] == "3"
    assert SHARED_THREADS not in trials.env(alone=True)
    workers = LocalStarter(size=2)
    assert workers.all_cores is None and workers._env["OMP_NUM_THREADS"] == "3"


class Started:
    """A backend that records what the controller starts (the jobs themselves are tested in tests/integration)."""

    def __init__(self):
        self.runs = []

    def start(self, args, run_dir, alone=False):
        self.runs.append(args)
        return {"pid": len(self.runs), "logs": []}


def test_a_user_s_enqueued_point_the_search_never_asked_does_not_take_a_confirmation_trial_s_place(tmp_path):
    """The budget (here n_trials) ended the search with enqueued points left WAITING: study.ask takes the oldest
    WAITING trial, so the confirmation's first trial was given a search point's place (a KeyError in CI)."""
    points = [{"kd_ratio": 0.1, "lora_rank": 4}, {"kd_ratio": 0.2, "lora_rank": 8}, {"kd_ratio": 0.3, "lora_rank": 16}]
    s = SweepSettings(study_name="c", sampler="random", seed=0, pruner="none", n_trials=1, enqueue=points,
                      confirm={"top": 1, "seeds": 3, "baseline_trials": 0}, params=SPACE)
    backend = Started()
    c = Controller(s, parse_space(SPACE), ["train=smoke"], tmp_path, backend)
    c._start(c._ask())
    c._record(0, Outcome("COMPLETE", values=[2.0]), exit_code=0)
    assert not c._search_may_ask()
    item = c._confirmation_item()
    c._start(c._ask(item))
    states = {t.number: (t.state.name, t.user_attrs) for t in c.study.trials}
    assert states[1][0] == states[2][0] == "FAIL" and states[1][1]["reason"].startswith("never ran")
    confirm_trial = c.study.trials[3]
    assert confirm_trial.state.name == "RUNNING" and confirm_trial.user_attrs["confirm"] == item
    assert confirm_trial.params == points[0] and c.manifest.trial(3)["confirm"] == item
    assert "train.seed=" in " ".join(backend.runs[-1])


def test_a_sweep_without_confirmation_leaves_no_enqueued_point_waiting(tmp_path):
    from test_budget import Recorded

    points = [{"kd_ratio": 0.1, "lora_rank": 4}, {"kd_ratio": 0.2, "lora_rank": 8}]
    s = SweepSettings(study_name="c", sampler="random", seed=0, pruner="none", n_trials=1, enqueue=points,
                      poll_s=0.0, params=SPACE)
    Controller(s, parse_space(SPACE), ["train=smoke"], tmp_path, Recorded()).run()
    study = optuna.load_study(study_name="c", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "FAIL"]
    assert study.trials[1].user_attrs["reason"] == "never ran: the search ended first"
