"""Preemption: turn SLURM's warning signal into a checkpoint at the next step boundary, then hand over.

SLURM (and submitit, which asks for it) sends USR2 some time before a job is preempted or hits its time limit.
Stopping mid-step would lose the step and could leave ranks disagreeing, so the handler only raises a flag;
the loop checks it after each optimizer step (agreed across ranks), writes a checkpoint, and returns. Then
``handover`` gives the signal to whoever handled it before kdsweep (submitit's handler requeues the job and
exits); with no such handler, rank 0 requeues the SLURM job itself.

Inside a SLURM job, SIGTERM is watched too: SLURM sends it when it preempts or requeues a job (``scontrol
requeue``), cancels it or ends it at its time limit, and kills it KillWait (or GraceTime) seconds later. The job
writes its checkpoint at the next step boundary and exits; SLURM itself decides whether the job runs again.

``scontrol requeue`` run from inside the job is one of the job's processes: the requeue it asks for sends SIGTERM to
every one of them, itself included, and on a busy node that can arrive before it exits. submitit then sees its
requeue command "die with SIGTERM" and records an error for a job that was in fact requeued (its controller, or
Hydra's launcher, reads that error and gives the job up while SLURM runs it again). :func:`requeue` runs it with
SIGTERM ignored, and :func:`harden_submitit_requeue` makes submitit's requeue do the same.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from types import FrameType

log = logging.getLogger(__name__)


class PreemptionWatch:
    """Catch USR2 (and SIGTERM inside a SLURM job) while installed; ``requested`` says whether one arrived."""

    def __init__(self) -> None:
        signums = [signal.SIGUSR2] + ([signal.SIGTERM] if "SLURM_JOB_ID" in os.environ else [])
        if "SLURM_JOB_ID" in os.environ:
            harden_submitit_requeue()
        self.received: int | None = None
        self._previous = {s: signal.signal(s, self._on_signal) for s in signums}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            log.warning("received %s: stopping after this step to write a checkpoint", signal.Signals(signum).name)
            self.received = signum

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)

    def handover(self, rank: int) -> None:
        """After the checkpoint: let the previous handler (submitit's) requeue and exit, or requeue ourselves."""
        self.restore()
        if self.received == signal.SIGTERM:
            log.info("stopped at SIGTERM: SLURM requeues the job or ends it")
            return
        previous = self._previous[signal.SIGUSR2]
        if callable(previous):
            previous(signal.SIGUSR2, None)
            return
        job = os.environ.get("SLURM_JOB_ID")
        if rank == 0 and job:
            log.info("requeueing SLURM job %s", job)
            requeue(job, check=False)


def _ignore_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # an ignored signal stays ignored across exec


def requeue(job_id: str, check: bool = True) -> int:
    """``scontrol requeue <job_id>``, which the SIGTERM of the requeue it asks for cannot kill; its exit code."""
    return subprocess.run(["scontrol", "requeue", job_id], check=check, timeout=60,
                          preexec_fn=_ignore_sigterm).returncode


def harden_submitit_requeue() -> None:
    """submitit's requeue (its USR2 handler's, after checkpoint()) through :func:`requeue` (idempotent)."""
    try:
        from submitit.core import logger as submitit_log
        from submitit.slurm.slurm import SlurmJobEnvironment
    except ImportError:  # no submitit: nothing of it to harden
        return
    if getattr(SlurmJobEnvironment._requeue, "kdsweep", False):
        return

    def _requeue(self: SlurmJobEnvironment, countdown: int) -> None:
        requeue(self.job_id)
        submitit_log.get_logger().info(f"Requeued job {self.job_id} ({countdown} remaining timeouts)")  # as submitit

    _requeue.kdsweep = True  # type: ignore[attr-defined]
    SlurmJobEnvironment._requeue = _requeue
