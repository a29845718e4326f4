"""One trial's own files: ``run.json`` (the run record) and ``metrics.jsonl`` (every logged row)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kdsweep.config.schema import ConfigError
from kdsweep.metrics.records import read_run


def read_record(run_dir: Path) -> dict[str, Any] | None:
    """The run record, or None when the job never wrote one."""
    return read_run(run_dir) or None


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every row of ``metrics.jsonl`` in file order ([] when there is none). A last line without its newline is
    a write still in progress (a running or killed job) and is skipped; any other bad line is an error."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    rows = []
    for i, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):  # unterminated: the writer was interrupted mid-line
                break
            raise ConfigError(f"{path}:{i} is not a JSON line; the history is damaged") from None
        if (not isinstance(row, dict) or row.get("kind") not in ("train", "eval")
                or not isinstance(row.get("step"), int)):
            raise ConfigError(f"{path}:{i} is not a metrics row (needs kind train|eval and an integer step)")
        rows.append(row)
    return rows
