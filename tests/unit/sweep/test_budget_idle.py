"""Warm workers idle while nothing may start: the budget counts the device time they hold, so a worker with no trial
to take leaves as soon as only the budget could give it one (the controller's ``release_idle``). Simulated time;
the workers account for their idle time as ``kdsweep.worker`` does (``worker.json``: idle_s, state, updated)."""

import json
from pathlib import Path

import pytest

from test_budget import FULL_S, MIXED, Clock, Simulated, own_storage_env, spent, timed_sweep  # noqa: F401

# own_storage_env (autouse): the controller exports the study's URL to its jobs; it must not outlive this module's


class OnWorkers(Simulated):
    """:class:`Simulated` trials handed to up to ``size`` warm workers that count the time they wait for a task."""

    def __init__(self, clock: Clock, plan, root: Path, size: int = 3) -> None:
        super().__init__(clock, plan)
        self.root, self.size, self.workers, self.released = root / "workers", size, {}, []

    def _save(self, name: str) -> None:
        w = self.workers[name]
        (self.root / name).mkdir(parents=True, exist_ok=True)
        (self.root / name / "worker.json").write_text(json.dumps(
            {"name": name, "state": w["state"], "idle_s": w["idle_s"], "updated": w["since"], "ranks": 1,
             "trials_run": 0}))

    def _stop_idling(self, name: str, state: str) -> None:
        w = self.workers[name]
        w.update(state=state, idle_s=w["idle_s"] + self.clock.now - w["since"], since=self.clock.now)
        self._save(name)

    def start(self, args, run_dir: Path, alone=False):
        idle = [n for n, w in self.workers.items() if w["state"] == "idle"]
        if not idle:
            assert len([w for w in self.workers.values() if w["state"] == "busy"]) < self.size
            idle = [f"w{len(self.workers)}"]
            self.workers[idle[0]] = {"state": "idle", "idle_s": 0.0, "since": self.clock.now}
        self._stop_idling(idle[0], "busy")
        return {**super().start(args, run_dir, alone), "worker": idle[0]}

    def poll(self, job):
        code = super().poll(job)
        if code is not None:  # the worker waits for its next task from the trial's end
            self.workers[job["worker"]].update(state="idle", since=job["t0"] + job["seconds"])
            self._save(job["worker"])
        return code

    def release_idle(self, why):
        idle = [n for n, w in self.workers.items() if w["state"] == "idle"]
        self.released.append((self.clock.now, idle))
        for name in idle:
            self._stop_idling(name, "left")

    def close(self):
        self.release_idle("the sweep is over")


@pytest.mark.parametrize("budget_s", [1100.0, 1250.0, 1400.0])
def test_workers_with_nothing_to_take_leave_and_the_budget_holds(tmp_path, monkeypatch, budget_s):
    backend = OnWorkers(Clock(), MIXED, tmp_path)
    monkeypatch.setattr("kdsweep.sweep.workers.time", backend.clock)
    manifest = timed_sweep(tmp_path, monkeypatch, backend, n_trials=None, budget=budget_s / 3600.0,
                           confirm={"top": 1, "seeds": 3, "baseline_trials": 0, "more_seeds": 0})
    # (kept warm till the sweep's end, the idle workers overran every one of these budgets by more than a trial)
    idle = sum(w["idle_s"] for w in backend.workers.values())
    assert budget_s - FULL_S <= spent(manifest) <= budget_s + FULL_S, (spent(manifest), idle)
    assert any(names for _, names in backend.released[:-1])  # some left before the sweep's end


class Starter:
    """Workers that stay alive (a worker told to leave may take a while to)."""

    def __init__(self) -> None:
        self.launched = []

    def launch(self, sweep_dir: Path, name: str) -> dict:
        self.launched.append(name)
        return {"pid": len(self.launched), "name": name}

    def alive(self, info: dict) -> bool:
        return True


def test_the_pool_sends_only_idle_workers_away_and_a_leaving_one_does_not_hold_a_slot(tmp_path):
    from kdsweep.sweep.workers import WorkerPool

    starter = Starter()
    pool = WorkerPool(2, tmp_path, {"nproc": 1}, starter)
    first = pool.start(["a"], tmp_path / "0")
    pool.start(["b"], tmp_path / "1")
    (tmp_path / "workers" / first["worker"] / "done-1.json").write_text(json.dumps({"exit_code": 0}))
    pool.release_idle("no trial may start until the budget allows it")
    tasks = {p.parent.name: json.loads(p.read_text()) for p in (tmp_path / "workers").glob("w*/task-2.json")}
    assert tasks == {"w0": {"seq": 2, "stop": True}}  # w1 runs trial 1: it stays
    third = pool.start(["c"], tmp_path / "2")  # w0 is still leaving (alive): a new worker takes the trial
    assert third["worker"] == "w2" and starter.launched == ["w0", "w1", "w2"]
    pool.release_idle("no trial may start until the budget allows it")  # nobody idle: w0 is not told twice
    assert not (tmp_path / "workers" / "w0" / "task-3.json").exists()


def test_a_controller_that_stops_with_an_error_sends_its_idle_workers_away_and_leaves_busy_ones(tmp_path, monkeypatch):
    """Before, idle workers of a controller stopped by an exception held their devices (and a SLURM cluster's
    CPUs) until worker_idle_s; a running trial goes on, for `kdsweep resume` to adopt."""
    from kdsweep.sweep.controller import Controller
    from kdsweep.sweep.space import parse_space
    from kdsweep.sweep.study import SweepSettings
    from kdsweep.sweep.workers import WorkerPool

    class FirstEndsAtItsFirstPoll(WorkerPool):
        def poll(self, job):
            if job["logs"][0].endswith("/0/job.log"):
                (tmp_path / "workers" / job["worker"] / f"done-{job['seq']}.json").write_text('{"exit_code": 0}')
            return super().poll(job)

    def a_bug(self, number, exit_code):
        raise RuntimeError("a bug while judging a trial")

    monkeypatch.setattr(Controller, "_finish", a_bug)
    s = SweepSettings(study_name="e", sampler="random", seed=0, pruner="none", poll_s=0.0, n_trials=4,
                      max_concurrent=2, params={"kd_ratio": "interval(0.0,1.0)"})
    pool = FirstEndsAtItsFirstPoll(2, tmp_path, {"nproc": 1}, Starter())
    with pytest.raises(RuntimeError, match="a bug"):
        Controller(s, parse_space({"kd_ratio": "interval(0.0,1.0)"}), ["train=smoke"], tmp_path, pool).run()
    last = {p.parent.name: json.loads(p.read_text()) for p in sorted((tmp_path / "workers").glob("w*/task-*.json"))}
    assert last["w0"] == {"seq": 2, "stop": True} and "stop" not in last["w1"]  # w1 still runs trial 1
