"""A sweep's device-hour budget and wall-clock limit: the controller's asks on a real Optuna study, with jobs that end
at once and record what they cost (the real trials: tests/integration/test_sweep.py)."""

import json
import os
from pathlib import Path

import pytest

from kdsweep.config import ConfigError
from kdsweep.sweep.budget import Budget, budget_lines
from kdsweep.sweep.controller import Controller
from kdsweep.sweep.manifest import STORAGE_ENV, Manifest
from kdsweep.sweep.space import parse_space
from kdsweep.sweep.study import SweepSettings

SPACE = {"kd_ratio": "interval(0.0,1.0)"}
TRIAL_S = 100.0  # what each job records: wall seconds (× its ranks: device-seconds)


@pytest.fixture(autouse=True)
def own_storage_env():
    before = os.environ.get(STORAGE_ENV)
    yield
    os.environ.pop(STORAGE_ENV, None)
    if before is not None:
        os.environ[STORAGE_ENV] = before


class Recorded:
    """Jobs that end at their first poll, having written the run.json a completed trial of ``ranks`` writes."""

    def __init__(self, ranks: int = 1, seconds: float = TRIAL_S) -> None:
        self.ranks, self.seconds, self.started = ranks, seconds, 0

    def start(self, args, run_dir: Path, alone=False):
        self.started += 1
        run_dir.mkdir(parents=True, exist_ok=True)
        return {"run_dir": str(run_dir), "logs": []}

    def poll(self, job):
        record = {"status": "completed", "world_size": self.ranks, "eval_after": {"student_ce": 1.0},
                  "config": {"train": {"max_steps": 4}},
                  "cost": {"trial_seconds": self.seconds, "device_seconds": self.seconds * self.ranks}}
        (Path(job["run_dir"]) / "run.json").write_text(json.dumps(record))
        return 0

    def find(self, args, run_dir):
        return None

    def close(self):
        pass


def sweep(tmp_path, backend, **settings):
    s = SweepSettings(**{"study_name": "b", "sampler": "random", "seed": 0, "pruner": "none", "poll_s": 0.0,
                         "max_concurrent": 2, **settings})
    return Controller(s, parse_space(SPACE), ["train=smoke"], tmp_path, backend).run()


def spent(manifest: Manifest) -> float:
    return manifest.data["budget"]["device_seconds_spent"]


@pytest.mark.parametrize("ranks, budget_s", [(1, 1050.0), (1, 1000.0), (2, 1999.0)])
def test_the_sweep_asks_until_its_budget_is_spent_and_overruns_it_by_at_most_one_trial(tmp_path, ranks, budget_s):
    backend = Recorded(ranks)
    manifest = sweep(tmp_path, backend, budget=budget_s / 3600.0)  # n_trials null: the budget alone stops it
    trial = TRIAL_S * ranks
    assert budget_s <= spent(manifest) < budget_s + trial
    assert len(manifest.trials) == backend.started == -(-budget_s // trial)
    assert all(t["state"] == "COMPLETE" for t in manifest.trials.values())
    line = budget_lines(Manifest.load(tmp_path))
    assert len(line) == 1 and f"of {budget_s / 3600:.4g} device-h spent" in line[0]
    assert f"over by {spent(manifest) - budget_s:.0f} device-s" in line[0] or "left 0 device-s" in line[0]


def test_n_trials_still_caps_a_budgeted_sweep_and_without_either_a_sweep_has_eight(tmp_path):
    assert len(sweep(tmp_path / "a", Recorded(), budget=1.0, n_trials=3).trials) == 3
    assert len(sweep(tmp_path / "b", Recorded()).trials) == 8


def test_a_resumed_sweep_continues_the_same_budget(tmp_path):
    first = sweep(tmp_path, Recorded(), budget=450 / 3600.0)
    assert len(first.trials) == 5
    again = Recorded()
    second = sweep(tmp_path, again, budget=450 / 3600.0)  # the same command again: nothing is left to spend
    assert again.started == 0 and len(second.trials) == 5
    more = Recorded()
    third = sweep(tmp_path, more, budget=650 / 3600.0)  # a larger budget on resume: only the difference is spent
    assert more.started == 2 and len(third.trials) == 7 and 650 <= spent(third) < 750


def test_no_trial_starts_that_would_end_after_the_wall_clock_limit(tmp_path, monkeypatch):
    first = sweep(tmp_path, Recorded(), n_trials=2)  # trials of 100 wall seconds each
    first.data["wall_s"] = 3600.0 - 150.0  # what the earlier controllers ran: 150 s left
    first.save()
    clock = {"now": 1e9}

    class Clock:
        time = staticmethod(lambda: clock["now"])

    class Timed(Recorded):  # the budget's clock moves on by a trial's seconds as each trial ends
        def poll(self, job):
            clock["now"] += self.seconds
            return super().poll(job)

    monkeypatch.setattr("kdsweep.sweep.budget.time", Clock)
    backend = Timed()
    manifest = sweep(tmp_path, backend, wall_hours=1.0)
    assert backend.started == 2 and len(manifest.trials) == 4  # two at a time end at 3550 s; a third would not fit
    assert manifest.data["wall_s"] == pytest.approx(3450.0 + 200.0)


def test_a_trial_still_running_counts_at_least_its_time_so_far_and_a_failed_one_without_a_record_its_run(tmp_path):
    manifest = Manifest.open(tmp_path, SweepSettings(), [], [])
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "run.json").write_text(json.dumps({"world_size": 4, "cost": {"device_seconds": 8.0}}))
    import time

    manifest.put(0, run_dir=str(tmp_path / "0"), state="RUNNING", started=time.time() - 10.0)
    manifest.put(1, run_dir=str(tmp_path / "1"), state="FAIL", started=100.0, ended=103.0)
    budget = Budget(manifest, 1.0, None)
    assert 40.0 <= budget.trial_spent(manifest.trial(0), time.time()) < 45.0  # 10 s × 4 ranks, not the stale 8
    assert budget.trial_spent(manifest.trial(1), time.time()) == 3.0
    assert budget.per_trial() == (None, None)  # no finished trial has a record: a trial's cost is unknown


@pytest.mark.parametrize("field", ["budget", "wall_hours"])
def test_a_limit_that_is_not_positive_is_one_line(field):
    with pytest.raises(ConfigError, match=rf"hydra.sweeper.{field}=0 must be > 0 hours \(or null: no limit\)"):
        SweepSettings(**{field: 0})


class OnWarmWorkers(Recorded):
    """Two workers of 2 ranks: each one's first trial starts cold (the worker's own 28 s of start-up, its boot, then
    2 s as any trial's), the later ones warm (2 s); every trial then trains for 20 s."""

    def __init__(self) -> None:
        super().__init__(ranks=2)
        self.workers_seen = 0

    def poll(self, job):
        cold = self.workers_seen < 2
        self.workers_seen += 1
        startup = 30.0 if cold else 2.0
        record = {"status": "completed", "world_size": 2, "eval_after": {"student_ce": 1.0},
                  "config": {"train": {"max_steps": 4}},
                  "environment": {"worker": {"name": "w", "start": "cold" if cold else "warm",
                                             "boot_seconds": 28.0 if cold else 0.0}},
                  "cost": {"trial_seconds": startup + 20.0, "device_seconds": 2 * (startup + 20.0),
                           "startup_seconds": startup}}
        (Path(job["run_dir"]) / "run.json").write_text(json.dumps(record))
        return 0


def test_a_workers_one_time_start_up_is_not_expected_of_the_next_trials(tmp_path):
    # 2 cold trials (100 device-s each), then warm ones (44), and a confirmation of 6 trials reserved: the estimate
    # is a warm trial's, so the search goes on and the sweep ends within one warm trial of its budget; expecting
    # every trial to pay a cold start, it would stop searching after the first two (200 + 6 × 100 reserved)
    manifest = sweep(tmp_path, OnWarmWorkers(), n_trials=None, budget=600 / 3600.0, confirm={"top": 1, "seeds": 3})
    spent = manifest.data["budget"]["device_seconds_spent"]
    search = [t for t in manifest.trials.values() if not t.get("confirm")]
    assert manifest.data["budget"]["trial_device_seconds"] == pytest.approx(44.0)
    assert len(search) > 2 and 600 - 44 <= spent < 600 + 44, (len(search), spent)
