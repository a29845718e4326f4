"""Metric sinks behind one logger. The loop logs unconditionally; non-main ranks get no sinks."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol


class Sink(Protocol):
    def write(self, row: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


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

    def close(self) -> None:
        self._f.close()


class MetricLogger:
    """Fan a row out to every sink."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def log(self, kind: str, step: int, values: dict[str, Any]) -> None:
        row = {"kind": kind, "step": step, **values}
        for sink in self.sinks:
            sink.write(row)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
