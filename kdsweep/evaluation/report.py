"""``kdsweep eval``: trained students on downstream tasks through lm-evaluation-harness, as one table.

    kdsweep eval <target> [<target> ...] [--tasks T,...] [--include DIR] [--no-base] [--json PATH]

A target is a Hugging Face model directory (an export's ``merged/``, or any model), a run directory (its trained
student: the merged model it kept, else exported as ``kdsweep export`` does into ``<run>/export/<name>``) or a sweep
directory: every seed of the point its verdict confirmed and every seed of its CE-only baseline, each a row of its
mean over the seeds ± the 95% t interval across them. Beside them, unless ``--no-base``, the undistilled base
student the runs trained from. Each row also says how far it lies from the base, in standard errors of the
difference (lm-eval's standard error of a model's score over the items; across seeds, that of their mean).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kdsweep.config.schema import ConfigError

EVAL_JSON = "eval.json"
"""A sweep directory's last ``kdsweep eval`` table (``tasks`` and ``rows``, as ``--json`` writes them)."""


@dataclass
class Entry:
    """A row of the table: one model, or the seeds of one confirmed point."""

    name: str
    models: list[Path]
    base: str | None = None  # the base student its runs trained from
    is_base: bool = False  # the row of that base itself
    scores: list[dict[str, dict[str, Any]]] = field(default_factory=list)  # per model: {task: headline}


def _run_model(run_dir: Path, name: str) -> tuple[Path, str | None]:
    """A completed run's trained student as a model directory, and the base student it trained from."""
    from kdsweep.checkpoint.package import CARD, completed_record, export_run

    record = completed_record(run_dir)
    base = (record.get("models") or {}).get("student")
    merged = (record.get("exports") or {}).get("merged")
    if merged and Path(merged).is_dir():
        return Path(merged), base
    out = run_dir / "export" / name
    if not (out / CARD).exists():
        export_run(run_dir, out, {}, name)
    return out / "merged", base


def _sweep_entries(sweep_dir: Path) -> list[Entry]:
    """The confirmed point's seeds and CE-only's, or (no confirmation) the search's best."""
    from kdsweep.checkpoint.package import confirmed_runs, pick
    from kdsweep.sweep.confirm import BASELINE
    from kdsweep.sweep.manifest import Manifest

    manifest = Manifest.load(sweep_dir)
    best = (manifest.data.get("verdict") or {}).get("best")
    if not best:
        (name, run_dir), = pick(sweep_dir, None, False)[0]
        model, base = _run_model(run_dir, name)
        return [Entry(f"{sweep_dir.name}/{name}", [model], base)]
    entries = []
    for label in (best, BASELINE):
        made = [_run_model(run_dir, name) for name, run_dir in confirmed_runs(manifest, label)]
        if made:
            entries.append(Entry(f"{label} ({len(made)} seed{'s' * (len(made) > 1)})", [m for m, _ in made],
                                 made[0][1]))
    return entries


def entries(targets: list[Path]) -> list[Entry]:
    """The table's rows, one or two per target (a sweep: its confirmed point and CE-only)."""
    from kdsweep.models.check import check_model_dir

    rows = []
    for path in targets:
        if (path / "sweep.json").exists():
            rows += _sweep_entries(path)
        elif (path / "run.json").exists():
            model, base = _run_model(path, path.name)
            rows.append(Entry(path.name, [model], base))
        elif (path / "config.json").exists():
            check_model_dir("eval", str(path), path)  # weights, or one line
            rows.append(Entry(path.name, [path]))
        else:
            raise ConfigError(f"{path} is neither a model directory (config.json), a run directory (run.json) nor a "
                              "sweep directory (sweep.json); pass one of those")
    return rows


def summary(entry: Entry, task: str) -> dict[str, Any]:
    """An entry's score on ``task``: the model's, or the mean over its seeds; its 95% half-width and standard error."""
    from scipy.stats import t as student_t

    got = [s[task] for s in entry.scores]
    values = [g["value"] for g in got]
    if len(values) == 1:
        se = got[0]["stderr"]
        half = None if se is None else 1.959964 * se
    else:
        se = statistics.stdev(values) / math.sqrt(len(values))
        half = float(student_t.ppf(0.975, len(values) - 1)) * se
    return {"name": entry.name, "task": task, "metric": got[0]["metric"], "value": statistics.fmean(values),
            "half_width": half, "stderr": se, "values": values, "items": got[0]["items"], "models": len(values)}


def compare(row: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """``row`` against the base: the difference and how many standard errors of the difference it is."""
    diff = row["value"] - base["value"]
    se = math.hypot(row["stderr"] or 0.0, base["stderr"] or 0.0)
    return {"vs_base": diff, "vs_base_se": diff / se if se > 0 else None}


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    width = max(len(r["name"]) for r in rows)
    lines = []
    for task in dict.fromkeys(r["task"] for r in rows):
        first = next(r for r in rows if r["task"] == task)
        lines.append(f"{task} ({first['metric']}, {first['items']} items; ± is the 95% interval: over the items for "
                     "one model, the t interval over the seeds for several)")
        for r in (r for r in rows if r["task"] == task):
            half = "" if r["half_width"] is None else f" ± {r['half_width']:.4f}"
            versus = ""
            if r.get("vs_base") is not None:
                se = "" if r["vs_base_se"] is None else f" ({r['vs_base_se']:+.1f} SE)"
                versus = f"   vs base {r['vs_base']:+.4f}{se}"
            lines.append(f"  {r['name']:<{width}}  {r['value']:.4f}{half}{versus}")
    return lines


def main(args: list[str]) -> None:
    from kdsweep.evaluation.harness import evaluate, require_lm_eval, task_manager
    from kdsweep.evaluation.task import TASK

    parser = argparse.ArgumentParser(prog="kdsweep eval", description="Trained students on downstream tasks through "
                                     "lm-evaluation-harness, beside CE-only and the undistilled base.")
    parser.add_argument("targets", type=Path, nargs="+", help="model, run or sweep directories")
    parser.add_argument("--tasks", default=TASK, help=f"comma-separated lm-eval tasks (default: {TASK}, shipped)")
    parser.add_argument("--include", type=Path, action="append", default=[], help="a directory of task YAMLs")
    parser.add_argument("--no-base", action="store_true", help="leave out the undistilled base student")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--limit", type=int, default=None, help="at most this many items of each task")
    parser.add_argument("--json", type=Path, default=None, help="write the table's rows here")
    ns = parser.parse_args(args)
    require_lm_eval()  # not installed: one line before anything is exported
    tasks = [t for t in ns.tasks.split(",") if t]
    for d in ns.include:
        if not d.is_dir():
            raise ConfigError(f"--include {d}: no such directory; pass a directory of lm-eval task YAMLs")
    manager = task_manager(tasks, ns.include)  # an unknown task: one line before any model is exported or loaded
    rows_in = entries([t.resolve() for t in ns.targets])
    bases = list(dict.fromkeys(e.base for e in rows_in if e.base))
    if not ns.no_base:
        rows_in += [Entry(f"base: {Path(b).name}", [Path(b)], base=b, is_base=True) for b in bases]
    for entry in rows_in:
        entry.scores = [evaluate(m, tasks, manager, ns.batch_size, ns.limit) for m in entry.models]
    rows = []
    for task in tasks:
        base_rows = {e.base: summary(e, task) for e in rows_in if e.is_base}
        for entry in rows_in:
            row = {**summary(entry, task), "is_base": entry.is_base}
            if entry.base in base_rows and not entry.is_base:
                row.update(compare(row, base_rows[entry.base]))
            rows.append(row)
    for line in table_lines(rows):
        print(line, flush=True)
    table = json.dumps({"tasks": tasks, "rows": rows}, indent=2) + "\n"
    if ns.json is not None:
        ns.json.write_text(table)
    for sweep in [t for t in ns.targets if (t / "sweep.json").exists()]:  # the analysis notebook reads it there
        (sweep / EVAL_JSON).write_text(table)
        print(f"saved in {sweep / EVAL_JSON} (notebooks/sweep_analysis.ipynb shows it)", flush=True)


__all__ = ["EVAL_JSON", "Entry", "compare", "entries", "main", "summary", "table_lines"]
