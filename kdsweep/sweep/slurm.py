"""Trials as SLURM jobs (``hydra/launcher=submitit_slurm``): submitit submits, ``sacct`` says how each one is.

The controller drives submitit itself with the launcher's settings (partition, tasks, GPUs, time,
``additional_parameters``, ``setup``), one job per trial, so a trial is a multi-rank job: every SLURM task runs
``TrialJob``, which is the kdsweep app on the trial's arguments, and each task is one rank. A job warned of its
time limit or preemption (USR2) writes a checkpoint and submitit requeues it; a job requeued by SLURM
(``scontrol requeue``, preemption) reruns the same callable. Either way it keeps its job id and resumes from its
checkpoint in the trial's directory: it stays the same trial. Job states come from SLURM, not from result files,
so a job that crashed, was cancelled or timed out is seen even when it wrote nothing.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kdsweep.config.schema import ConfigError

# States after which SLURM will not run the job again (a REQUEUED or PENDING job is still on its way) ...
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE")
# ... except these, which a cluster that requeues (JobRequeue=1, PreemptMode=REQUEUE) turns back into PENDING:
# believed only once they have lasted this long.
MAYBE_REQUEUED, REQUEUE_GRACE_S = ("PREEMPTED", "NODE_FAIL"), 120.0


def sweep_tag(sweep_dir: Path) -> str:
    """What a sweep's job names end with: its directory's hash (never another sweep's jobs)."""
    return hashlib.sha1(str(sweep_dir.resolve()).encode()).hexdigest()[:8]


class TrialJob:
    """What every task of a trial's SLURM job runs: ``python -m kdsweep ARGS``, in-process."""

    def __call__(self, args: list[str]) -> None:
        from kdsweep.app import main

        sys.argv = ["kdsweep", *args]
        main()

    def checkpoint(self, args: list[str]) -> Any:
        """submitit's requeue hook: run the same arguments again (the job resumes from its own checkpoint)."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, args)


class WorkerJob:
    """What every task of a warm worker's SLURM job runs (``hydra.sweeper.workers``): ``kdsweep.worker.serve``, each
    task one rank of the worker's process group, trial after trial."""

    def __call__(self, sweep_dir: str, name: str) -> None:
        from kdsweep.worker import serve

        serve(sweep_dir, name)

    def checkpoint(self, sweep_dir: str, name: str) -> Any:
        """submitit's requeue hook: the requeued job is the same worker again (its trial was checkpointed)."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, sweep_dir, name)


def executor_for(launcher: dict[str, Any]) -> Any:
    """A submitit SLURM executor from ``hydra.launcher``'s settings, read as hydra-submitit-launcher reads them."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    params = {k: v for k, v in launcher.items() if k != "_target_"}
    executor = submitit.AutoExecutor(folder=params.pop("submitit_folder"), cluster="slurm",
                                     slurm_max_num_timeout=params.pop("max_num_timeout"))
    common = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in common else f"slurm_{k}": v for k, v in params.items()})
    # A task that dies (kill -9, out of memory) ends its job at once: otherwise its job's other ranks wait in a
    # collective until dist.timeout_s, and SLURM shows the job RUNNING all that time.
    executor.update_parameters(slurm_srun_args=["--kill-on-bad-exit=1"])
    return executor


def slurm_states(job_ids: list[str]) -> dict[str, tuple[str, str]] | None:
    """``{job id: (state, exit code)}`` from sacct (a requeued job's last record wins); None if sacct failed."""
    try:
        out = subprocess.run(["sacct", "-X", "--parsable2", "--noheader", "-o", "JobID,State,ExitCode",
                              "-j", ",".join(job_ids)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    states = {}
    for line in out.stdout.splitlines():
        parts = line.split("|")
        if len(parts) == 3:
            states[parts[0]] = (parts[1].split()[0] if parts[1] else "UNKNOWN", parts[2])
    return states


class SlurmJobs:
    """The controller's backend for SLURM: ``start`` submits a trial's job, ``poll`` reads its state."""

    MISSING_POLLS = 30  # sacct answered this often without the job: it is gone (purged, or lost)

    def __init__(self, launcher: dict[str, Any], study_name: str, refresh_s: float = 2.0) -> None:
        self.launcher, self.study_name, self.refresh_s = launcher, study_name, refresh_s
        self._executor = None
        self._known: dict[str, tuple[str, str]] = {}
        self._missing: dict[str, int] = {}
        self._seen_ended: dict[str, float] = {}
        self._when = 0.0

    def preflight(self) -> None:
        """Ask sbatch (``--test-only``: nothing is submitted) whether it would take a job with these settings."""
        import tempfile

        from submitit.slurm.slurm import _make_sbatch_string

        self._executor = self._executor or executor_for(self.launcher)
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "check.sh"
            script.write_text(_make_sbatch_string(command="true", folder=tmp, **self._executor._executor.parameters))
            try:
                out = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60)
            except FileNotFoundError:
                raise ConfigError("hydra/launcher=submitit_slurm but sbatch is not on PATH: run the sweep on a "
                                  "SLURM login node (or bring up launchers/slurm/up.sh)") from None
        if out.returncode != 0:
            lines = [line for line in out.stderr.strip().splitlines() if line.strip()] or [f"exit {out.returncode}"]
            raise ConfigError(f"SLURM refuses the trials' jobs ({lines[-1][:300]}); check hydra.launcher "
                              "(partition, time, resources)")

    def job_name(self, run_dir: Path) -> str:
        """The trial's SLURM job name: the study, the trial's number and its sweep (a resumed controller finds the
        job by it, and never another sweep's)."""
        if run_dir.parent.name == "packs":  # a packed job's (hydra.sweeper.pack): packs/<its first member>
            return f"{self.study_name}-pack{run_dir.name}-{sweep_tag(run_dir.parent.parent)}"
        return f"{self.study_name}-{run_dir.name}-{sweep_tag(run_dir.parent)}"

    def submit(self, name: str, what: str, fn: Any, *args: Any) -> Any:
        """Submit ``fn(*args)`` as SLURM job ``name``; sbatch's refusal is one line naming ``what`` was refused."""
        import submitit

        self._executor = self._executor or executor_for(self.launcher)
        self._executor.update_parameters(name=name)
        try:
            job = self._executor.submit(fn, *args)
        except (subprocess.CalledProcessError, submitit.core.utils.FailedJobError) as e:
            detail = (getattr(e, "stderr", None) or getattr(e, "output", None) or str(e))
            detail = detail.decode(errors="replace") if isinstance(detail, bytes) else str(detail)
            raise ConfigError(f"sbatch refused {what} ({detail.strip().splitlines()[-1][:300]}); "
                              "check hydra.launcher (partition, time, resources)") from None
        self._when = 0.0  # see the new job at the next poll
        return job

    def start(self, args: list[str], run_dir: Path, alone: bool = False) -> dict[str, Any]:
        """Submit the trial's job (``alone`` changes nothing: a SLURM job has the resources its launcher names)."""
        job = self.submit(self.job_name(run_dir), f"trial {run_dir.name}'s job", TrialJob(), args)
        return {"slurm_job_id": str(job.job_id), "logs": [str(job.paths.stdout), str(job.paths.stderr)]}

    def find(self, args: list[str], run_dir: Path) -> dict[str, Any] | None:
        """The trial's job if SLURM has one (queued, running or ended), by its name: a controller that died between
        submitting it and writing it down adopts it instead of submitting it again."""
        import submitit

        try:
            out = subprocess.run(["sacct", "-X", "--parsable2", "--noheader", "-o", "JobID", "--name",
                                  self.job_name(run_dir), "-S", "now-30days"], capture_output=True, text=True,
                                 timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        ids = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        if out.returncode != 0 or not ids:
            return None
        paths = submitit.core.utils.JobPaths(self.launcher["submitit_folder"], job_id=ids[-1], task_id=0)
        self._when = 0.0
        return {"slurm_job_id": ids[-1], "logs": [str(paths.stdout), str(paths.stderr)]}

    def poll(self, job: dict[str, Any]) -> int | None | str:
        job_id = job["slurm_job_id"]
        self._missing.setdefault(job_id, 0)
        if time.time() - self._when > self.refresh_s:  # one sacct call for every job in flight
            known = slurm_states(sorted(self._missing))
            if known is not None:  # sacct failed: ask again at the next poll
                self._known = known
                self._missing = {j: 0 if j in known else n + 1 for j, n in self._missing.items()}
            self._when = time.time()
        if self._missing[job_id] >= self.MISSING_POLLS:
            del self._missing[job_id]
            return "gone"
        state, exit_code = self._known.get(job_id, ("", ""))
        if state not in ENDED:
            self._seen_ended.pop(job_id, None)
            return None  # pending, running, requeued, or not listed yet
        first = self._seen_ended.setdefault(job_id, time.time())
        if state in MAYBE_REQUEUED and time.time() - first < REQUEUE_GRACE_S:
            return None
        del self._missing[job_id], self._seen_ended[job_id]
        if state == "COMPLETED":
            return 0
        if state == "FAILED":
            code = exit_code.split(":")[0]
            return int(code) if code.isdigit() and code != "0" else 1
        return state  # cancelled, timed out, node failure ...: the job did not end on its own

    def release_idle(self, why: str) -> None:
        pass  # a trial's job ends with it: nothing idles

    def close(self) -> None:
        pass  # every job has ended: nothing is held

    def worker_starter(self) -> "SlurmStarter":
        return SlurmStarter(self)


class SlurmStarter:
    """Warm workers as SLURM jobs (``kdsweep.sweep.workers.WorkerPool``): one job per worker with the launcher's
    nodes, tasks and GPUs, submitted by submitit; alive while sacct has not seen it end (a requeued job lives on)."""

    threads = all_cores = None  # a job has the cores its launcher asks for

    def __init__(self, jobs: SlurmJobs) -> None:
        self.jobs, self._ended = jobs, set()

    def launch(self, sweep_dir: Path, name: str) -> dict[str, Any]:
        job = self.jobs.submit(f"{self.jobs.study_name}-worker-{name}-{sweep_tag(sweep_dir)}", f"worker {name}'s job",
                               WorkerJob(), str(sweep_dir), name)
        return {"slurm_job_id": str(job.job_id), "log": str(job.paths.stderr), "logs": [str(job.paths.stdout),
                                                                                         str(job.paths.stderr)]}

    def alive(self, info: dict[str, Any]) -> bool:
        job_id = info["slurm_job_id"]
        if job_id not in self._ended and self.jobs.poll({"slurm_job_id": job_id}) is not None:
            self._ended.add(job_id)  # an end sacct reported (past the requeue grace) is final
        return job_id not in self._ended

    def reap(self, info: dict[str, Any]) -> None:
        pass  # SLURM ended every task of the job

    def close(self) -> None:
        pass  # every worker was told to stop: their jobs end on their own
