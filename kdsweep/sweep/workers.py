"""The controller's backend for warm trial workers (``hydra.sweeper.workers=N``, ``hydra/launcher=basic``).

Instead of one process per trial, the pool keeps up to N long-lived workers (``kdsweep.worker``), each a local
process group of ``dist.nproc_per_node`` ranks, and hands each trial to an idle one through the sweep directory:
``workers/<name>/task-<seq>.json`` (written atomically; writing it is the launch, so ``find`` looks there for a
trial a dead controller was starting). The worker answers with ``done-<seq>.json`` (the exit code its job would
have left); the controller judges the trial from its run directory and exit code exactly as for a job.

A worker that dies is replaced by a new one (a new name; its trial is retried by the controller, from its
checkpoint, as an attempt); workers that die before they ever get ready stop the sweep with one line. A resumed
controller re-attaches to the workers still alive (``worker.json``: pid and start time) and to their trials.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kdsweep.config.schema import ConfigError
from kdsweep.metrics.records import JOB_STARTED, write_json_atomic
from kdsweep.sweep.manifest import STORAGE_ENV

log = logging.getLogger(__name__)


def worker_dir(sweep_dir: Path, name: str) -> Path:
    """Where worker ``name`` of a sweep keeps its spec, its tasks and answers, its state and its log."""
    return sweep_dir / "workers" / name


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file written atomically, or None while it does not exist."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None

def worker_names(sweep_dir: Path) -> list[str]:
    """The sweep's workers, in the order they were started (w0, w1, ...)."""
    root = sweep_dir / "workers"
    return sorted((p.name for p in root.iterdir() if p.is_dir()), key=lambda n: int(n[1:])) if root.is_dir() else []


FAILED_STARTS = 2
"""Workers that may die before they ever get ready, none having got ready, before the sweep stops."""


class LocalStarter:
    """Local workers (``hydra/launcher=basic``): each a process of this machine, seen by its pid and start time."""

    def __init__(self, size: int) -> None:
        self._procs: dict[int, subprocess.Popen] = {}
        cores = len(os.sched_getaffinity(0))
        self.threads = max(1, cores // size)  # concurrent workers share the cores (as LocalProcesses' trials do)
        self._env = {k: v for k, v in os.environ.items() if k != JOB_STARTED}
        self._env.setdefault("OMP_NUM_THREADS", str(self.threads))
        self.all_cores = cores if "OMP_NUM_THREADS" not in os.environ else None

    def launch(self, sweep_dir: Path, name: str) -> dict[str, Any]:
        from kdsweep.sweep.local import proc_stat

        env = {**self._env, STORAGE_ENV: os.environ[STORAGE_ENV]}
        with open(worker_dir(sweep_dir, name) / "worker.log", "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "kdsweep.worker", str(sweep_dir), name], stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, env=env)
        self._procs[proc.pid] = proc
        stat = proc_stat(proc.pid)
        return {"pid": proc.pid, "started": stat[19] if stat else None}

    def alive(self, info: dict[str, Any]) -> bool:
        from kdsweep.sweep.local import proc_stat

        proc = self._procs.get(info.get("pid"))
        if proc is not None:
            return proc.poll() is None
        stat = proc_stat(info["pid"]) if "pid" in info else None  # a worker an earlier controller started
        return stat is not None and stat[0] != "Z" and stat[19] == info.get("started")

    def reap(self, info: dict[str, Any]) -> None:
        """A dead worker's ranks go with it: its launching process led their process group (a worker killed with
        kill -9 leaves ranks that would still write into its trial's directory)."""
        if info.get("pid"):
            try:
                os.killpg(info["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def close(self) -> None:
        for proc in self._procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


class WorkerPool:
    """The Backend: trials handed to up to ``size`` workers that ``starter`` starts (local processes, SLURM jobs)."""

    def __init__(self, size: int, sweep_dir: Path, spec: dict[str, Any], starter: Any) -> None:
        self.size, self.sweep_dir, self.spec, self.starter = size, sweep_dir, spec, starter
        self.root = sweep_dir / "workers"
        self.root.mkdir(parents=True, exist_ok=True)
        self.failed_starts, self.any_ready, self._counted = 0, False, set()

    # -- the workers -------------------------------------------------------------------------------------------
    def _names(self) -> list[str]:
        return worker_names(self.sweep_dir)

    def _state(self, name: str) -> dict[str, Any]:
        return read_json(worker_dir(self.sweep_dir, name) / "worker.json") or {}

    def alive(self, name: str) -> bool:
        info = read_json(worker_dir(self.sweep_dir, name) / "launch.json")
        return info is not None and self.starter.alive(info)

    def _last_seq(self, name: str) -> int:
        d = worker_dir(self.sweep_dir, name)
        return max((int(p.stem.split("-")[1]) for p in d.glob("task-*.json")), default=0)

    def _idle(self, name: str) -> bool:
        seq = self._last_seq(name)
        return seq == 0 or (worker_dir(self.sweep_dir, name) / f"done-{seq}.json").exists()

    def _leaving(self, name: str) -> bool:
        """Whether the worker was told to leave (it takes no trial more)."""
        seq = self._last_seq(name)
        return seq > 0 and bool((read_json(worker_dir(self.sweep_dir, name) / f"task-{seq}.json") or {}).get("stop"))

    def _staying(self) -> list[str]:
        """The live workers not told to leave."""
        return [n for n in self._names() if self.alive(n) and not self._leaving(n)]

    def _tell_to_leave(self, names: list[str]) -> None:
        for name in names:
            seq = self._last_seq(name) + 1
            write_json_atomic(worker_dir(self.sweep_dir, name) / f"task-{seq}.json", {"seq": seq, "stop": True})

    def _launch(self) -> str:
        name = f"w{len(self._names())}"
        d = worker_dir(self.sweep_dir, name)
        d.mkdir(parents=True)
        write_json_atomic(d / "spec.json", self.spec)
        launched = time.time()
        info = self.starter.launch(self.sweep_dir, name)
        write_json_atomic(d / "launch.json", {**info, "launched": launched})
        log.info("worker %s started (%s, %d rank(s) each)", name,
                 f"slurm {info['slurm_job_id']}" if "slurm_job_id" in info else f"pid {info['pid']}",
                 self.spec.get("nproc", 1))
        return name

    def _count_dead(self) -> None:
        """Workers that died before getting ready: after FAILED_STARTS of them, none ready, the sweep stops."""
        for name in self._names():
            state = self._state(name)
            self.any_ready = self.any_ready or bool(state.get("ready"))
            if not state.get("ready") and not self.alive(name) and name not in self._counted:
                self._counted.add(name)
                self.failed_starts += 1
        if self.failed_starts >= FAILED_STARTS and not self.any_ready:
            last = worker_dir(self.sweep_dir, self._names()[-1])
            log_path = Path((read_json(last / "launch.json") or {}).get("log") or last / "worker.log")
            raise ConfigError(f"no trial worker could start ({self.failed_starts} died before they were ready: "
                              f"{_last_line(log_path)}); see {log_path}")

    # -- Backend -------------------------------------------------------------------------------------------------
    def start(self, args: list[str], run_dir: Path, alone: bool = False) -> dict[str, Any]:
        self._count_dead()
        live = self._staying()  # a worker leaving may still be alive: it takes no trial, and a new one may start
        idle = [n for n in live if self._idle(n)]
        if not idle and len(live) >= self.size:
            raise RuntimeError(f"no idle worker among {live} (the controller keeps at most {self.size} trials running)")
        name = idle[0] if idle else self._launch()
        seq = self._last_seq(name) + 1
        threads = getattr(self.starter, "threads", None)  # local workers share this machine's cores
        task = {"seq": seq, "trial": int(run_dir.name), "run_dir": str(run_dir), "args": args, "threads": threads,
                "shared_threads": None}
        if alone and getattr(self.starter, "all_cores", None):  # the teacher pass gets every core, then shares them
            task.update(threads=self.starter.all_cores, shared_threads=threads)
        write_json_atomic(worker_dir(self.sweep_dir, name) / f"task-{seq}.json", task)
        return self._job(name, seq, run_dir)

    def _job(self, name: str, seq: int, run_dir: Path) -> dict[str, Any]:
        """The trial's job: its task on worker ``name``; its log is its own (the worker's own log holds them all)."""
        return {"worker": name, "seq": seq, "logs": [str(run_dir / "job.log")]}

    def poll(self, job: dict[str, Any]) -> int | None | str:
        done = read_json(worker_dir(self.sweep_dir, job["worker"]) / f"done-{job['seq']}.json")
        if done is not None:  # the exit code its job would have left, or a word ("requeued": it did not end)
            return done["exit_code"]
        if self.alive(job["worker"]):
            return None
        self.starter.reap(read_json(worker_dir(self.sweep_dir, job["worker"]) / "launch.json") or {})
        self._count_dead()
        return "gone"

    def find(self, args: list[str], run_dir: Path) -> dict[str, Any] | None:
        """The task that assigned this trial to a worker, if it is still to run, running, or done."""
        for name in self._names():
            for seq in range(self._last_seq(name), 0, -1):
                task = read_json(worker_dir(self.sweep_dir, name) / f"task-{seq}.json") or {}
                if task.get("run_dir") == str(run_dir):
                    return self._job(name, seq, run_dir)
        return None

    def release_idle(self, why: str) -> None:
        """Nothing may start now (``why``): the idle workers leave (a worker waiting for a task holds its devices,
        and the budget counts that); a trial that starts later gets a new worker."""
        idle = [n for n in self._staying() if self._idle(n)]
        if idle:
            log.info("workers %s leave: %s", ", ".join(idle), why)
            self._tell_to_leave(idle)

    def close(self) -> None:
        """The sweep is over: every live worker leaves once it is idle (it is, since no trial runs); the sweep ends
        when they have (SLURM shows their jobs COMPLETED), or after two minutes."""
        self._tell_to_leave(self._staying())
        live = [n for n in self._names() if self.alive(n)]
        deadline = time.time() + 120
        while live and time.time() < deadline:
            time.sleep(0.5)
            live = [n for n in live if self.alive(n)]
        if live:
            log.warning("workers %s did not leave within 2 minutes of the sweep's end", ", ".join(live))
        self.starter.close()


def _last_line(path: Path) -> str:
    if not path.exists():
        return "no log"
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return (lines[-1] if lines else "no output").removeprefix("kdsweep: error: ")[:300]


def worker_states(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every worker the sweep started, as its ``worker.json`` says (a worker that never got ready: its launch)."""
    root = sweep_dir / "workers"
    return [read_json(root / n / "worker.json") or {"name": n, "state": "starting", "trials_run": 0, "idle_s": 0.0,
                                                     "ranks": (read_json(root / n / "spec.json") or {}).get("nproc", 1)}
            for n in worker_names(sweep_dir)]


def idle_device_seconds(sweep_dir: Path) -> float:
    """Seconds the workers held their devices without a trial (× their ranks): the sweep pays for them too. A
    worker idle now adds the time since it said so (its ``idle_s`` grows only when it takes a task or leaves)."""
    now = time.time()
    return sum((w.get("idle_s", 0.0) + (max(now - w["updated"], 0.0) if w.get("state") == "idle" and "updated" in w
                                        else 0.0)) * w.get("ranks", 1) for w in worker_states(sweep_dir))


def worker_lines(sweep_dir: Path) -> list[str]:
    """``kdsweep status``: each worker, its job, the trials it ran, what it runs now and how long it sat idle."""
    trials = (read_json(sweep_dir / "sweep.json") or {}).get("trials", {})
    lines = []
    for w in worker_states(sweep_dir):
        job = f"slurm {w['slurm']['job_id']}" if w.get("slurm") else f"pid {w['pid']}" if w.get("pid") else "-"
        now = w.get("state", "?")
        if now == "busy":  # a worker killed mid-trial still says so, once its trial has gone to another
            moved = (trials.get(str(w.get("trial")), {}).get("job") or {}).get("worker") not in (None, w["name"])
            now = f"gone while it ran trial {w['trial']}" if moved else f"running trial {w['trial']}"
        lines.append(f"worker {w['name']} ({job}, {w.get('ranks', 1)} rank(s)): {w.get('trials_run', 0)} trials run, "
                     f"{now}, idle {w.get('idle_s', 0.0):.1f} s")
    return lines
