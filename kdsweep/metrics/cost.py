"""What one attempt of a run costs, as ``run.json`` records it (``cost``, ``costs``; kdsweep.metrics.records)."""

from __future__ import annotations

import time
from typing import Callable

from kdsweep.distributed import DistEnv
from kdsweep.metrics.records import ALIGNMENT_FIELDS


class CostMeter:
    """Counts this rank's trained tokens; :meth:`snapshot` sums everything over ranks (a collective: every rank
    calls it at the same step)."""

    def __init__(self, dist: DistEnv, started: float, teacher_tokens: Callable[[], dict[str, int]],
                 built_tokens: int = 0, seconds: Callable[[float], float] = lambda started: time.time() - started,
                 ) -> None:
        """``seconds(started)``: the wall seconds since ``started`` this trial accounts for (a pack's member its
        share of them: :class:`kdsweep.pack.job.Member`)."""
        self.dist, self.started, self.teacher_tokens, self.built_tokens = dist, started, teacher_tokens, built_tokens
        self.seconds = seconds
        self.trained_tokens, self.teacher_generated, self.steps, self.loop_started = 0, 0, 0, time.time()

    def start_loop(self) -> None:
        self.loop_started = time.time()

    def step(self, local_tokens: int, teacher_generated: int = 0) -> None:
        """A step that trained on ``local_tokens`` on this rank, the teacher having generated ``teacher_generated``."""
        self.trained_tokens += local_tokens
        self.teacher_generated += teacher_generated
        self.steps += 1

    def snapshot(self) -> dict[str, float]:
        """Steps, trained tokens, wall seconds from the job's start (its share of them × ranks: device-seconds),
        seconds of the step loop, and the teacher positions computed (the cache build's and the tokens it generated
        too) and read from a cache, over all ranks."""
        tokens = self.teacher_tokens()
        trained, computed, read, generated = (sum(self.dist.gather_floats(float(v))) for v in (
            self.trained_tokens, tokens["teacher_tokens_computed"], tokens["teacher_tokens_read"],
            self.teacher_generated))
        wall = time.time() - self.started
        alignment = {k: sum(self.dist.gather_floats(float(v))) for k, v in tokens.items() if k in ALIGNMENT_FIELDS}
        return {**alignment, "steps": self.steps, "train_tokens": trained, "trial_seconds": wall,
                "device_seconds": self.seconds(self.started) * self.dist.world_size,
                "loop_seconds": time.time() - self.loop_started,
                "startup_seconds": self.loop_started - self.started,
                "teacher_tokens_computed": computed + self.built_tokens + generated, "teacher_tokens_read": read,
                "teacher_tokens_generated": generated}
