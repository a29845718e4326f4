"""Preemption: turn SLURM's warning signal into a checkpoint at the next step boundary, then hand over.

SLURM (and submitit, which asks for it) sends USR2 some time before a job is preempted or hits its time limit.
Stopping mid-step would lose the step and could leave ranks disagreeing, so the handler only raises a flag;
the loop checks it after each optimizer step (agreed across ranks), writes a checkpoint, and returns. Then
``handover`` gives the signal to whoever handled it before kdsweep (submitit's handler requeues the job and
exits); with no such handler, rank 0 requeues the SLURM job itself.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from types import FrameType

log = logging.getLogger(__name__)


class PreemptionWatch:
    """Catch ``signum`` while installed; ``requested`` says whether it arrived."""

    def __init__(self, signum: int = signal.SIGUSR2) -> None:
        self.signum = signum
        self.requested = False
        self._previous = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.requested:
            log.warning("received %s: stopping after this step to write a checkpoint", signal.Signals(signum).name)
        self.requested = True

    def restore(self) -> None:
        signal.signal(self.signum, self._previous)

    def handover(self, rank: int) -> None:
        """After the checkpoint: let the previous handler (submitit's) requeue and exit, or requeue ourselves."""
        self.restore()
        if callable(self._previous):
            self._previous(self.signum, None)
            return
        job = os.environ.get("SLURM_JOB_ID")
        if rank == 0 and job:
            log.info("requeueing SLURM job %s", job)
            subprocess.run(["scontrol", "requeue", job], check=False)
