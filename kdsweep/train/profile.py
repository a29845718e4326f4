"""``profiler.enabled``: a torch.profiler trace of a few training steps, and on a GPU a CUDA memory snapshot.

Each rank writes ``<run dir>/profile/trace_rank<r>.json`` (Chrome trace format: chrome://tracing, Perfetto,
TensorBoard's profiler plugin) and, on CUDA, ``memory_snapshot_rank<r>.pickle`` (https://pytorch.org/memory_viz).
Off, the loop gets an object whose ``step`` does nothing: nothing is imported, nothing is recorded.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import TracebackType

import torch

from kdsweep.config import ProfilerConfig

log = logging.getLogger(__name__)


class NoProfiler:
    def __enter__(self) -> "NoProfiler":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def step(self) -> None:
        return None


class StepProfiler:
    """torch.profiler over ``wait + warmup + active`` steps; ``step()`` after each optimizer step."""

    def __init__(self, cfg: ProfilerConfig, out: Path, device: torch.device, rank: int) -> None:
        self.dir, self.rank = out / "profile", rank
        self.cuda = device.type == "cuda"
        activities = ([torch.profiler.ProfilerActivity.CPU]
                      + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else []))
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
            on_trace_ready=self._save,
            record_shapes=cfg.record_shapes, profile_memory=True, with_stack=cfg.with_stack,
        )

    def _save(self, prof: torch.profiler.profile) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / f"trace_rank{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        if self.cuda:
            torch.cuda.memory._dump_snapshot(str(self.dir / f"memory_snapshot_rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        log.info("profiler: trace written to %s", trace)

    def __enter__(self) -> "StepProfiler":
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._prof.__enter__()
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._prof.__exit__(exc_type, exc, tb)
        if self.cuda:  # a run that ended before the active steps: stop recording all the same
            torch.cuda.memory._record_memory_history(enabled=None)

    def step(self) -> None:
        self._prof.step()


def step_profiler(cfg: ProfilerConfig, out: Path, device: torch.device, rank: int) -> NoProfiler | StepProfiler:
    return StepProfiler(cfg, out, device, rank) if cfg.enabled else NoProfiler()
