"""A sweep that packs its trials by itself (hydra.sweeper.pack=auto: the memory plan fits max_concurrent=2 on this
machine): 4 trials in 2 packs of 2 on a warm worker, each
member still its own trial (pruned on its own, judged from its own record); the controller killed (kill -9) right
after it launched the second pack, then `kdsweep resume`: the pack adopted, not started again, no row twice, and a
packed trial equal to the same trial run as its own process. A search that cannot be packed: test_sweep's BAD."""

import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from conftest import QUIET, kdsweep, read_metrics, read_run
from test_sweep import manifest, search, study
from test_workers import computed

pytestmark = pytest.mark.slow

POINTS = [{"kd_ratio": 0.5, "lr": 0.01, "lora_rank": 8}, {"kd_ratio": 0.0, "lr": 0.003, "lora_rank": 4},
          {"kd_ratio": 1.0, "lr": 0.01, "lora_rank": 16}, {"kd_ratio": 0.5, "lr": 1e-6, "lora_rank": 8}]
"""The enqueued points, in order: the first pack (0, 1) trains with nothing to prune against; in the second, trial 3
(a learning rate that learns nothing) is worse than both at its first evaluation and is pruned there."""


@pytest.fixture(scope="module")
def packed(tmp_path_factory, zoo_dirs):
    tmp_path = tmp_path_factory.mktemp("pack_sweep")
    sweep_dir = tmp_path / "sweep"
    args = search(tmp_path, "packed", {
        "n_trials": 4, "max_concurrent": 2, "pack": "auto", "sampler": "random", "pruner": "median",
        "pruner_startup_trials": 2, "pruner_warmup_steps": 0, "enqueue": POINTS,
        "params": {"kd_ratio": "choice(0.0,0.5,1.0)", "lr": "choice(1e-6,0.003,0.01)", "lora_rank": "choice(4,8,16)"},
    }, {"train": {"eval_every": 2, "max_steps": 6}, "checkpoint": {"save_every": 2}})
    base = [*args[1:], "train.threads=1", *QUIET]
    with ThreadPoolExecutor(2) as pool:  # trial 2 alone, beside the sweep (each on one core)
        killed = pool.submit(kdsweep, *args, "train.threads=1", *QUIET, f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path,
                             check=False, env_extra={"KDSWEEP_TEST_CRASH_AT": "after_launch:2"})
        alone = tmp_path / "alone-2"
        pool.submit(kdsweep, *base, *(f"{k}={v}" for k, v in POINTS[2].items()), f"hydra.run.dir={alone}",
                    cwd=tmp_path).result()
        killed = killed.result()
    died = manifest(sweep_dir)
    resumed = kdsweep("resume", str(sweep_dir), cwd=tmp_path, check=False)
    status = kdsweep("status", str(sweep_dir), cwd=tmp_path, check=False)
    return SimpleNamespace(sweep_dir=sweep_dir, killed=killed, died=died, resumed=resumed, status=status, alone=alone,
                           base=base)


def test_a_packed_sweep_resumed_after_kill_9_adopts_its_pack_and_judges_each_member(packed):
    sweep_dir = packed.sweep_dir
    assert packed.killed.returncode == -9, packed.killed.stderr[-3000:]
    assert {n: t["state"] for n, t in packed.died["trials"].items()} == {
        "0": "COMPLETE", "1": "COMPLETE", "2": "STARTING", "3": "STARTING"}  # the pack launched, not written down
    assert packed.resumed.returncode == 0, packed.resumed.stderr[-3000:]
    trials = manifest(sweep_dir)["trials"]
    assert [t.state.name for t in study(sweep_dir, "packed").trials] == ["COMPLETE", "COMPLETE", "COMPLETE", "PRUNED"]
    assert {n: t["pack"]["members"] for n, t in trials.items()} == {"0": [0, 1], "1": [0, 1], "2": [2, 3],
                                                                     "3": [2, 3]}
    assert all(t["attempts"] == 1 for t in trials.values())  # the second pack adopted by the resume, not restarted
    assert sorted(p.name for p in (sweep_dir / "packs").iterdir()) == ["0", "2"]
    tasks = [json.loads(p.read_text()) for p in sorted((sweep_dir / "workers" / "w0").glob("task-*.json"))]
    assert [t["args"] for t in tasks if not t.get("stop")] == [["--pack", str(sweep_dir / "packs" / n)]
                                                               for n in ("0", "2")]  # one task per pack
    for n, t in trials.items():  # each member its own trial: its params, its steps, every row once
        record = read_run(sweep_dir / n)
        assert record["config"]["loss"]["kd_ratio"] == POINTS[int(n)]["kd_ratio"]
        assert record["config"]["model"]["lora_rank"] == POINTS[int(n)]["lora_rank"]
        rows = [(r["kind"], r["step"]) for r in read_metrics(sweep_dir / n)]
        assert len(rows) == len(set(rows)), n
        assert record["status"] == ("pruned" if n == "3" else "completed")
        assert record["steps"] == (2 if n == "3" else 6)
        if n != "3":
            assert t["values"] == [pytest.approx(record["eval_after"]["student_ce"])]
    logs = {n: (sweep_dir / n / "kdsweep.log").read_text() for n in ("2", "3")}  # each member's own lines
    assert "pruned at step 2" in logs["3"] and "pruned at step" not in logs["2"]
    assert "held-out CE after 6 steps" in logs["2"] and "after 6 steps" not in logs["3"]
    cost = {n: read_run(sweep_dir / n)["cost"] for n in trials}
    # the first member of a pack counts its pack's teacher tokens: the training targets and the evaluations its members
    # made together; the others count none; the sweep's baseline is counted once, by trial 0, which evaluated it
    evals = {n: sum(r["kind"] == "eval" and r["step"] > 0 for r in read_metrics(sweep_dir / n)) for n in ("0", "2")}
    per_eval = (cost["2"]["teacher_tokens_computed"] - cost["2"]["train_tokens"]) / evals["2"]
    assert cost["1"]["teacher_tokens_computed"] == cost["3"]["teacher_tokens_computed"] == 0 and per_eval > 0
    assert cost["0"]["teacher_tokens_computed"] - cost["0"]["train_tokens"] == (evals["0"] + 1) * per_eval
    for pack in (("0", "1"), ("2", "3")):  # the members' device-seconds are shares of their pack's
        wall = max(cost[n]["trial_seconds"] for n in pack)
        assert sum(cost[n]["device_seconds"] for n in pack) == pytest.approx(wall, rel=0.05), pack


def test_a_packed_trial_equals_the_same_trial_run_alone(packed):
    assert packed.resumed.returncode == 0, packed.resumed.stderr[-3000:]
    own = [a for a in manifest(packed.sweep_dir)["trials"]["2"]["args"] if not a.startswith(("trial.", "hydra.run"))]
    assert sorted(own) == sorted([*packed.base, *(f"{k}={v}" for k, v in POINTS[2].items())])
    a, b = read_run(packed.sweep_dir / "2"), read_run(packed.alone)
    assert a["eval_after"]["student_ce"] == pytest.approx(b["eval_after"]["student_ce"], abs=1e-5)
    rows_a, rows_b = computed(read_metrics(packed.sweep_dir / "2")), computed(read_metrics(packed.alone))
    assert [(r["kind"], r["step"]) for r in rows_a] == [(r["kind"], r["step"]) for r in rows_b]
    for ra, rb in zip(rows_a, rows_b):
        for k, v in rb.items():
            if isinstance(v, float):
                assert ra[k] == pytest.approx(v, abs=1e-5), (ra["step"], k)


def test_status_lists_every_member_as_a_trial(packed):
    assert packed.status.returncode == 0, packed.status.stderr
    lines = packed.status.stdout.splitlines()
    for n, state, pack in ((0, "COMPLETE", "0+1"), (1, "COMPLETE", "0+1"), (2, "COMPLETE", "2+3"),
                           (3, "PRUNED", "2+3")):
        assert any(line.split()[:2] == [str(n), state] and f"[pack {pack}]" in line for line in lines), lines
