"""Metric sinks behind one logger. The loop logs unconditionally; non-main ranks get no sinks.

Every sink takes the same rows (``{"kind": "train" | "eval", "step": s, ...values}``) and, at the end, the run's
summary. ``open_sinks`` picks them from the config: JSONL always, TensorBoard and W&B when enabled.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol


class Sink(Protocol):
    def write(self, row: dict[str, Any]) -> None: ...
    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Flush and close; ``summary`` (objective, final eval) when the run completed."""


class JsonlSink:
    """One JSON object per line. Resuming at step ``resume_step`` drops rows written after it (atomically), and
    a row whose (kind, step) is already there is not written again, so a history never holds a step twice."""

    def __init__(self, path: Path, resume_step: int = 0) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step > 0 and path.exists():
            kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= resume_step]
        self._seen = {(json.loads(line)["kind"], json.loads(line)["step"]) for line in kept}
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)  # a kill mid-rewrite leaves the old history, never half of it
        self._f = path.open("a", buffering=1)

    def write(self, row: dict[str, Any]) -> None:
        key = (row["kind"], row["step"])
        if key in self._seen:  # e.g. the final eval of a run rerun from its final checkpoint
            return
        self._seen.add(key)
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self._f.write(json.dumps(clean) + "\n")

    def close(self, summary: dict[str, Any] | None = None) -> None:
        self._f.close()


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """``{"<kind>/<name>": value}`` for the row's numbers (lists such as per-rank peaks are left to JSONL)."""
    return {f"{row['kind']}/{k}": v for k, v in row.items()
            if k not in ("kind", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardSink:
    """Event files in ``path``; a resumed run purges the events its first attempt wrote after the checkpoint."""

    def __init__(self, path: Path, resume_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(path), purge_step=resume_step + 1 if resume_step else None)

    def write(self, row: dict[str, Any]) -> None:
        for tag, value in scalars(row).items():
            self._writer.add_scalar(tag, value, row["step"])

    def close(self, summary: dict[str, Any] | None = None) -> None:
        self._writer.close()


class MetricLogger:
    """Fan a row out to every sink."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def log(self, kind: str, step: int, values: dict[str, Any]) -> None:
        row = {"kind": kind, "step": step, **values}
        for sink in self.sinks:
            sink.write(row)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        for sink in self.sinks:
            sink.close(summary)


def open_sinks(cfg: Any, out: Path, resume_step: int,
               config: dict[str, Any]) -> tuple[list[Sink], dict[str, Any] | None]:
    """The sinks ``cfg.logger`` asks for, and what identifies the W&B run (None without W&B)."""
    sinks: list[Sink] = [JsonlSink(out / "metrics.jsonl", resume_step=resume_step)]
    if cfg.logger.tensorboard:
        sinks.append(TensorBoardSink(out / "tensorboard", resume_step))
    wandb_info = None
    if cfg.logger.wandb.enabled:
        from kdsweep.metrics.wandb_run import WandbSink

        sink = WandbSink(cfg, out, config, resume_step)
        sinks.append(sink)
        wandb_info = sink.info
    return sinks, wandb_info
