"""A check's time budget, and how a check says it cannot run."""

from __future__ import annotations

import time


class Skip(Exception):
    """A check (or part of one) that cannot run here: recorded as ``skipped: <why>``."""


class Budget:
    """The seconds a check may still use: its own budget, within what is left of the whole run."""

    def __init__(self, seconds: float, run_deadline: float) -> None:
        self.deadline = min(time.monotonic() + seconds, run_deadline)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def need(self, seconds: float, what: str) -> None:
        """Raise Skip unless ``seconds`` are left (before a part that cannot stop half-way)."""
        if self.left() < seconds:
            raise Skip(f"{what}: {max(self.left(), 0):.0f} s of the budget left, it needs about {seconds:.0f}")
