"""Trials as local processes (``hydra/launcher=basic`` with ``hydra.sweeper.workers=0``): the controller's local
backend."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kdsweep.metrics.records import JOB_STARTED, SHARED_THREADS
from kdsweep.sweep.manifest import STORAGE_ENV


class LocalProcesses:
    """Trials as local processes (``hydra/launcher=basic``); each job may spawn its own ranks."""

    def __init__(self, max_concurrent: int) -> None:
        self._procs: dict[int, subprocess.Popen] = {}
        # Concurrent trials share the machine's cores: without a cap each would start a thread per core, and
        # oversubscribed OpenMP threads spin against each other (seen here: 2-step trials taking 10x longer).
        self._env = {k: v for k, v in os.environ.items() if k != JOB_STARTED}  # each trial counts from its own start
        self._env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // max_concurrent)))

    def env(self, alone: bool = False) -> dict[str, str]:
        """A trial's environment: its share of the cores, or, for a trial running ``alone`` (the teacher pass
        before the others start), every core for the pass and its share after it. OMP_NUM_THREADS, when the
        user set it, is kept either way."""
        env = {**self._env, STORAGE_ENV: os.environ[STORAGE_ENV]}
        if alone and "OMP_NUM_THREADS" not in os.environ:
            env.update(OMP_NUM_THREADS=str(len(os.sched_getaffinity(0))), **{SHARED_THREADS: env["OMP_NUM_THREADS"]})
        return env

    def start(self, args: list[str], run_dir: Path, alone: bool = False) -> dict[str, Any]:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "job.log", "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "kdsweep", *args], stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=self.env(alone))
        self._procs[proc.pid] = proc
        return {"pid": proc.pid, "started": proc_start(proc.pid), "logs": [str(run_dir / "job.log")]}

    def poll(self, job: dict[str, Any]) -> int | None | str:
        proc = self._procs.get(job["pid"])
        if proc is not None:
            return proc.poll()
        # A job started by an earlier controller (resume): not our child, so only liveness can be seen, and the
        # process must be the one started then (a pid can be reused by another process once it ended).
        stat = proc_stat(job["pid"])
        if stat is None or stat[0] == "Z" or (job.get("started") is not None and stat[19] != job["started"]):
            return "gone"
        return None

    def find(self, args: list[str], run_dir: Path) -> dict[str, Any] | None:
        """A live ``python -m kdsweep`` process of this trial (its command names the trial's run directory, or a
        packed job's its own)."""
        marker = (str(run_dir) if args[:1] == ["--pack"] else f"hydra.run.dir={run_dir}").encode()  # a pack: its dir
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker in argv and b"kdsweep" in argv and (stat := proc_stat(int(entry.name))) and stat[0] != "Z":
                return {"pid": int(entry.name), "started": stat[19], "logs": [str(run_dir / "job.log")]}
        return None

    def release_idle(self, why: str) -> None:
        pass  # a trial's process ends with it: nothing idles

    def close(self) -> None:
        pass


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first; [19] is the start time), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def proc_start(pid: int) -> str | None:
    stat = proc_stat(pid)
    return stat[19] if stat else None


__all__ = ["LocalProcesses", "proc_start", "proc_stat"]
