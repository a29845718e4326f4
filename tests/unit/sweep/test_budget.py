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

    def release_idle(self, why=""):
        pass

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


# -- trials that take time: heterogeneous, pruned, promoted and failing, several at once ---------------------------
STEPS, FULL_S = 10, 100.0  # a trial's steps, and what one run to its end costs (device-seconds, one rank)


class Clock:
    """The controller's and the budget's clock: the controller's poll sleeps move it on by a second."""

    def __init__(self) -> None:
        import time

        self.now = time.time()

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += 1.0


class Simulated:
    """Jobs that take simulated time, as real trials: each start takes the next of ``plan`` — ("complete", seconds),
    ("pruned", seconds) or ("fail", seconds) — and confirmation trials ("confirm" in their args) run
    ``confirm_s`` to their end. While running, a job logs its steps (metrics.jsonl, at FULL_S / STEPS seconds a
    step) and its record says it runs; at its end it writes the record a trial of that kind writes."""

    def __init__(self, clock: Clock, plan: list[tuple[str, float]], confirm_s: float = FULL_S) -> None:
        self.clock, self.plan, self.confirm_s, self.started = clock, list(plan), confirm_s, []

    def start(self, args, run_dir: Path, alone=False):
        confirming = any(a.startswith("train.seed=") for a in args)
        kind, seconds = ("complete", self.confirm_s) if confirming else self.plan[len(self.started) % len(self.plan)]
        self.started.append((kind, seconds, confirming))
        run_dir.mkdir(parents=True, exist_ok=True)
        self._write(run_dir, {"status": "running"})
        return {"run_dir": str(run_dir), "t0": self.clock.now, "kind": kind, "seconds": seconds, "logs": []}

    @staticmethod
    def _write(run_dir: Path, record: dict) -> None:
        base = {"world_size": 1, "config": {"train": {"max_steps": STEPS}}}
        (Path(run_dir) / "run.json").write_text(json.dumps({**base, **record}))

    def poll(self, job):
        elapsed = self.clock.now - job["t0"]
        steps = min(STEPS, int(min(elapsed, job["seconds"]) / (FULL_S / STEPS)))
        rows = [{"kind": "train", "step": s} for s in range(1, steps + 1)]
        (Path(job["run_dir"]) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if elapsed < job["seconds"]:
            return None
        cost = {"trial_seconds": job["seconds"], "device_seconds": job["seconds"], "startup_seconds": 0.0}
        status = {"complete": "completed", "pruned": "pruned", "fail": "failed"}[job["kind"]]
        self._write(job["run_dir"], {"status": status, "steps": steps, "cost": cost, "error": "RuntimeError: boom",
                                     "eval_after": {"student_ce": 4.0 + len(self.started) / 1000}})
        return 1 if job["kind"] == "fail" else 0

    def find(self, args, run_dir):
        return None

    def release_idle(self, why=""):
        pass

    def close(self):
        pass


def timed_sweep(tmp_path, monkeypatch, backend, cached=False, **settings):
    monkeypatch.setattr("kdsweep.sweep.budget.time", backend.clock)
    monkeypatch.setattr("kdsweep.sweep.controller.time", backend.clock)
    s = SweepSettings(**{"study_name": "b", "sampler": "random", "seed": 0, "pruner": "none", "poll_s": 1.0,
                         "max_concurrent": 3, **settings})
    return Controller(s, parse_space(SPACE), ["train=smoke"], tmp_path, backend, teacher_cache=cached).run()


MIXED = [("pruned", 30.0), ("complete", 100.0), ("pruned", 20.0), ("fail", 10.0), ("complete", 90.0),
         ("pruned", 40.0), ("complete", 100.0), ("pruned", 30.0)]


@pytest.mark.parametrize("budget_s", [1000.0, 1500.0])
def test_a_mixed_sweep_with_confirmation_spends_its_budget_to_within_one_full_trial(tmp_path, monkeypatch, budget_s):
    """Pruned early, promoted to the end and failing trials, 3 at once, then the best point and CE-only on 3 seeds:
    the budget is what ends it, and budget - one full trial <= spent <= budget + one full trial."""
    backend = Simulated(Clock(), MIXED)
    manifest = timed_sweep(tmp_path, monkeypatch, backend, n_trials=None, budget=budget_s / 3600.0,
                           confirm={"top": 1, "seeds": 3, "baseline_trials": 0})
    full = max(s for kind, s, _ in backend.started if kind == "complete")  # the largest completed trial
    assert budget_s - full <= spent(manifest) <= budget_s + full, (spent(manifest), len(backend.started))
    states = {t["state"] for t in manifest.trials.values()}
    assert {"COMPLETE", "PRUNED", "FAIL"} <= states
    assert sum(confirming for *_, confirming in backend.started) == 6 and "trials ran" not in manifest.data["verdict"][
        "line"]  # the confirmation got what it asked for


def test_before_any_trial_ends_the_slots_do_not_all_start_whatever_the_budget(tmp_path, monkeypatch):
    """Overrun path 1: nothing finished and no trial_hours: the first trial runs alone until its pace tells what a
    trial costs (it used to start every slot: 3 trials of 100 on a budget of 150)."""
    backend = Simulated(Clock(), [("complete", FULL_S)])
    manifest = timed_sweep(tmp_path, monkeypatch, backend, n_trials=None, budget=150 / 3600.0)
    assert spent(manifest) <= 150 + FULL_S and len(backend.started) == 2


def test_a_running_trial_that_may_be_promoted_is_reserved_a_full_trial(tmp_path, monkeypatch):
    """Overrun path 2: a history of trials pruned early (their median cost 10) made each running trial look nearly
    paid for, so three promoted to the end started at once near the budget's end; a pruned trial now tells what it
    would have cost at its end (its steps' pace: 100), and a running one is reserved that much."""
    plan = [("pruned", 10.0)] * 6 + [("complete", FULL_S)] * 10
    backend = Simulated(Clock(), plan)
    manifest = timed_sweep(tmp_path, monkeypatch, backend, n_trials=None, budget=400 / 3600.0)
    assert 400 - FULL_S <= spent(manifest) <= 400 + FULL_S, spent(manifest)


def test_confirmation_trials_ask_the_budget_and_the_verdict_says_what_it_cut(tmp_path):
    """Overrun path 3: confirmation trials started whatever was spent. Here the search spent 40 device-s (4 trials
    of 10), the controller died starting the first confirmation trial, and the sweep is resumed with a budget of 30:
    the trial it had asked runs (its number is the study's), no other starts (all 6 used to), and the verdict says
    what the budget cut."""
    from test_confirm import Recorded as Objective

    s = dict(study_name="b", sampler="random", seed=0, pruner="none", poll_s=0.0, max_concurrent=2, n_trials=4,
             confirm={"top": 1, "seeds": 3, "baseline_trials": 0})
    space = {"kd_ratio": "interval(0.0,1.0)", "lora_rank": "choice(4,8,16)"}
    with pytest.raises(KeyboardInterrupt):
        Controller(SweepSettings(**s), parse_space(space), ["train=smoke"], tmp_path, Objective(stop_after=4)).run()
    again = Objective()
    manifest = Controller(SweepSettings(**{**s, "budget": 30 / 3600.0}), parse_space(space), ["train=smoke"],
                          tmp_path, again).run()
    assert len(again.started) == 1 and again.started[0]["train.seed"] == "1000"  # the one asked before the death
    assert manifest.data["confirmation"]["cut"] == "the device budget was spent"
    line = manifest.data["verdict"]["line"]
    assert line.endswith("; 1 of its 6 trials ran: the device budget was spent before the rest"), line


CACHED_S, LIVE_S = 50.0, 150.0  # a search trial reading the teacher cache; a confirmation seed's, with the live teacher
BUILD = {"device_seconds": 30.0, "teacher_load_s": 5.0, "ranks": 1, "teacher_tokens": 10_000}
READ = (LIVE_S - CACHED_S - 5.0) / ((30.0 - 5.0) / 10_000)  # the tokens a cached trial reads: the build's rate prices
# the live teacher's work on them at exactly what a live trial costs here


class Cached(Simulated):
    """A search on the teacher cache whose confirmation seeds run live; the cache was built by its first trial
    (``in_sweep``), before the sweep (``before``: its meta.json says what the build took) or nobody knows how."""

    def __init__(self, clock: Clock, built: str, cache_dir: Path) -> None:
        super().__init__(clock, [("complete", CACHED_S)], confirm_s=LIVE_S)
        self.built, self.cache_dir = built, cache_dir
        cache_dir.mkdir(parents=True)
        (cache_dir / "meta.json").write_text(json.dumps({"built": BUILD if built == "before" else None}))

    def poll(self, job):
        code = super().poll(job)
        path = Path(job["run_dir"]) / "run.json"
        record = json.loads(path.read_text())
        if code is not None:
            record["cost"]["teacher_tokens_read"] = READ if job["seconds"] == CACHED_S else 0.0
            first = job["run_dir"].endswith("/0")
            record["teacher_targets"] = {"source": "cache", "dir": str(self.cache_dir),
                                         "build": BUILD if self.built == "in_sweep" and first else None}
            path.write_text(json.dumps(record))
        return code


@pytest.mark.parametrize("built", ["in_sweep", "before", "unknown"])
def test_a_live_confirmation_after_a_cached_search_is_priced_by_the_build_or_a_probe(tmp_path, monkeypatch, built):
    """Priced by the cached trials (50), the six live seeds (150 each) got 2 of 6 run (the search spent the rest).
    With the measured teacher rate of the cache's build (by a trial, or before the sweep) the search leaves them room
    and all six run; with no build to read the first seed runs alone as the probe and the budget cuts the rest."""
    backend = Cached(Clock(), built, tmp_path / "cache")
    manifest = timed_sweep(tmp_path, monkeypatch, backend, cached=True, n_trials=None, budget=1200 / 3600.0,
                           confirm={"top": 1, "seeds": 3, "baseline_trials": 0})
    seeds = [start for start in backend.started if start[2]]
    ended = manifest.data["confirmation"]["search_ended"]
    assert ended["priced_apart"] and spent(manifest) <= 1200 + LIVE_S, spent(manifest)
    if built != "unknown":
        assert ended["seed_device_seconds"] == pytest.approx(LIVE_S) and len(seeds) == 6
        assert 1200 - LIVE_S <= spent(manifest)
        return
    assert ended["seed_device_seconds"] is None and "trials ran: the device budget was spent" in manifest.data[
        "verdict"]["line"]
    numbers = sorted((t for t in manifest.trials.values() if t.get("confirm")), key=lambda t: t["number"])
    first_end = numbers[0]["ended"]  # the probe ran alone: no other seed started before its pace was known
    assert all(t["started"] >= numbers[0]["started"] + LIVE_S / STEPS for t in numbers[1:]), (first_end, numbers)
