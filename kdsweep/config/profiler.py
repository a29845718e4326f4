"""The ``profiler`` section: torch.profiler over a few training steps."""

from __future__ import annotations

from dataclasses import dataclass

from kdsweep.config.base import _check


@dataclass(frozen=True, kw_only=True)
class ProfilerConfig:
    """torch.profiler over a few training steps; off by default (and then it costs nothing)."""

    enabled: bool = False
    wait: int = 1
    """Steps to skip before profiling (the first steps pay one-off costs)."""
    warmup: int = 1
    """Steps traced but discarded (the profiler's own start-up)."""
    active: int = 3
    """Steps recorded into the trace."""
    record_shapes: bool = False
    """Each op's input shapes in the trace."""
    with_stack: bool = False
    """Each op's Python stack, and every Python function the traced steps call (``python_function`` events)."""

    def __post_init__(self) -> None:
        _check(self.wait >= 0 and self.warmup >= 0,
               f"profiler.wait={self.wait} and profiler.warmup={self.warmup} must be >= 0")
        _check(self.active >= 1, f"profiler.active={self.active} must be >= 1 (steps recorded)")
