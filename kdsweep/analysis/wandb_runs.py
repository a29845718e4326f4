"""The W&B runs of a sweep as DataFrames: from offline run directories, or from W&B's server.

Offline runs are read with wandb's own reader, ``wandb leet inspect`` (wandb 0.31 writes only the binary
``run-<id>.wandb`` log): ``--json`` prints one record per line (the run record with id, name, group and config;
every history row), ``--summary --json`` the run's config, summary and state. A job killed with SIGKILL before
wandb flushed leaves a log with no run record: it is skipped. A requeued or resumed job adds another
``offline-run-<time>-<id>`` directory with the same id; those segments are merged oldest first, and a key logged
again at the same step keeps the later value, so no step appears twice. Online runs come from
``wandb.Api().runs(path, filters={"group": ...})`` with ``run.scan_history()``, which is complete
(``run.history()`` samples).

    runs = load_wandb_runs(sweep_dir)           # offline dirs, or the server when the trials logged online
    runs = load_wandb_runs(("team", "kdsweep", "kd_optuna"))   # entity (None: yours), project, group
    runs.runs       one row per run: run_id, trial, name, group, project, state, segments, summary.<key>, config
    runs.history    run_id, trial, kind (train | eval), step, then the metrics (names without the kind/ prefix)
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from kdsweep.analysis.sweep import read_manifest, trial_dir
from kdsweep.config.schema import ConfigError
from kdsweep.metrics.records import read_run

KINDS = ("train", "eval")
_JSON_NUMBERS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}  # how W&B's JSON writes them


@dataclass
class RunData:
    """One W&B run, however it was read."""

    run_id: str
    name: str | None
    group: str | None
    project: str | None
    state: str | None
    config: dict[str, Any]
    summary: dict[str, Any]
    rows: list[dict[str, Any]]
    """History rows in order, each with ``_step``."""
    segments: list[str] = field(default_factory=list)
    """The offline run directories merged into this run (none for a run read from the server)."""


@dataclass
class WandbRuns:
    runs: pd.DataFrame
    history: pd.DataFrame


def load_wandb_runs(source: str | Path | tuple[str | None, str, str]) -> WandbRuns:
    """The W&B runs of a sweep directory, of any directory holding offline runs, or of a group on the server
    (``(entity, project, group)``). A sweep whose trials logged online is read from the server."""
    if isinstance(source, tuple):
        return _frames(api_runs(*source))
    path = Path(source).resolve()
    if not path.exists():
        raise ConfigError(f"{path} does not exist; pass a sweep directory, a directory of W&B runs or "
                          "(entity, project, group)")
    online = _online_group(path) if (path / "sweep.json").exists() else None
    if online is not None:
        return _frames(api_runs(*online))
    segments = sorted(_segment_dirs(path), key=lambda d: d.name)
    if not segments:
        raise ConfigError(f"no offline W&B run under {path}; were the jobs run with logger.wandb.enabled=true?")
    return _frames(offline_runs(segments))


def _online_group(sweep_dir: Path) -> tuple[str | None, str, str] | None:
    """(entity, project, group) when a trial of the sweep logged online (its run.json says so), else None."""
    manifest = read_manifest(sweep_dir)
    for entry in manifest["trials"].values():
        info = read_run(trial_dir(sweep_dir, entry)).get("wandb") or {}
        if info.get("mode") == "online":
            return info.get("entity"), info["project"], info["group"]
    return None


def _segment_dirs(path: Path) -> list[Path]:
    """Every ``offline-run-*`` directory holding a ``run-*.wandb`` log at or under ``path``."""
    candidates = [path] if path.name.startswith("offline-run-") else path.rglob("offline-run-*")
    return [d for d in candidates if d.is_dir() and any(d.glob("run-*.wandb"))]


# -- offline ------------------------------------------------------------------------------------------------
@dataclass
class Segment:
    """One offline-run directory: one attempt of a run."""

    directory: Path
    run: dict[str, Any]
    """The run record: run_id, display_name, run_group, project, start_time, config."""
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    """``--summary --json``: config, summary, state."""


def offline_runs(directories: list[Path]) -> list[RunData]:
    """Read offline run directories and merge the segments of each run id, oldest first."""
    by_id: dict[str, list[Segment]] = {}
    for directory in directories:
        records = _inspect(directory, summary=False)
        run = next((r["run"] for r in records if r.get("type") == "run"), None)
        if run is None:  # a job killed (SIGKILL) before wandb flushed its log leaves only the header
            continue
        by_id.setdefault(run["run_id"], []).append(Segment(directory, run, records, _inspect(directory, summary=True)))
    return [_merge(run_id, sorted(parts, key=lambda p: p.run.get("start_time", ""))) for run_id, parts in by_id.items()]


def _merge(run_id: str, segments: list[Segment]) -> RunData:
    """One run from its segments; where they overlap (a step, a config or summary key) the later one wins."""
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    rows: dict[int, dict[str, Any]] = {}
    for segment in segments:
        config.update(segment.summary.get("config") or {})
        summary.update(segment.summary.get("summary") or {})
        for record in segment.records:
            if record.get("type") == "history":
                item = record["history"]["item"]
                rows.setdefault(int(item["_step"]), {}).update(item)
    last = segments[-1]
    return RunData(
        run_id=run_id, name=last.run.get("display_name"), group=last.run.get("run_group"),
        project=last.run.get("project"), state=last.summary.get("state"), config=config, summary=summary,
        rows=[rows[s] for s in sorted(rows)], segments=[str(s.directory) for s in segments],
    )


def _inspect(directory: Path, summary: bool) -> Any:
    """``wandb leet inspect --json [--summary] <dir>``: a list of records, or the summary object."""
    proc = subprocess.run(_inspect_command(directory, summary), capture_output=True, text=True, timeout=300,
                          env={**os.environ, "WANDB_SILENT": "true"})
    if proc.returncode != 0:
        first = (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}").splitlines()[0]
        raise ConfigError(f"wandb leet inspect cannot read {directory}: {first}")
    if summary:
        return json.loads(proc.stdout) if proc.stdout.strip() else {}
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def _inspect_command(directory: Path, summary: bool) -> list[str]:
    """``wandb leet inspect`` is a thin Python wrapper that imports wandb (~1 s) to start wandb-core's own
    ``leet inspect``; calling that program directly, with the flags the wrapper passes, takes ~0.03 s."""
    flags = ["--json", *(["--summary"] if summary else [])]
    spec = importlib.util.find_spec("wandb")  # finds the package without importing it
    core = (Path(spec.submodule_search_locations[0]) / "bin" / "wandb-core"
            if spec and spec.submodule_search_locations else None)
    run_file = next(directory.glob("run-*.wandb"))
    if core is not None and core.exists():
        return [str(core), "leet", "inspect", "--no-observability", *flags, "--run-file", str(run_file),
                str(directory.parent)]
    beside = Path(sys.executable).with_name("wandb")  # the environment's own CLI, activated or not
    cli = str(beside) if beside.exists() else shutil.which("wandb")
    if not cli:
        raise ConfigError("wandb is not installed; pip install 'wandb>=0.31,<0.32'")
    return [cli, "leet", "inspect", *flags, str(directory)]


# -- online --------------------------------------------------------------------------------------------------
def api_runs(entity: str | None, project: str, group: str) -> list[RunData]:
    """The runs of ``group`` from W&B's server (needs a key and the network; not exercised by the tests)."""
    import wandb

    api = wandb.Api()
    path = f"{entity}/{project}" if entity else project
    return [
        RunData(run_id=r.id, name=r.name, group=r.group, project=project, state=r.state, config=dict(r.config),
                summary=dict(r.summary), rows=list(r.scan_history()))
        for r in api.runs(path, filters={"group": group})
    ]


# -- frames --------------------------------------------------------------------------------------------------
def _number(value: Any) -> Any:
    return _JSON_NUMBERS.get(value, value) if isinstance(value, str) else value


def trial_of(run: RunData) -> int | None:
    """The Optuna trial a run belongs to: its config's trial.number, else its name ``trial-<n>``."""
    trial = run.config.get("trial")
    if isinstance(trial, dict) and trial.get("sweep_dir") and isinstance(trial.get("number"), int):
        return trial["number"]
    match = re.fullmatch(r"trial-(\d+)", run.name or "")
    return int(match.group(1)) if match else None


def _frames(runs: list[RunData]) -> WandbRuns:
    meta, history = [], []
    for run in sorted(runs, key=lambda r: (trial_of(r) is None, trial_of(r) or 0, r.run_id)):
        trial = trial_of(run)
        meta.append({
            "run_id": run.run_id, "trial": trial, "name": run.name, "group": run.group, "project": run.project,
            "state": run.state, "segments": len(run.segments), "steps": len(run.rows),
            **{f"summary.{k}": _number(v) for k, v in run.summary.items() if not k.startswith("_")},
            "config": run.config, "dirs": run.segments,
        })
        for row in run.rows:
            for kind in KINDS:  # W&B holds a step's train and eval values in one row; split them back
                values = {k[len(kind) + 1:]: _number(v) for k, v in row.items() if k.startswith(f"{kind}/")}
                if values:
                    history.append({"run_id": run.run_id, "trial": trial, "kind": kind, "step": int(row["_step"]),
                                    **values})
    runs_frame = pd.DataFrame.from_records(meta)
    if not runs_frame.empty:
        runs_frame["trial"] = runs_frame["trial"].astype("Int64")
    history_frame = pd.DataFrame.from_records(history, columns=None if history else ["run_id", "trial", "kind", "step"])
    if not history_frame.empty:
        history_frame["trial"] = history_frame["trial"].astype("Int64")
    return WandbRuns(runs_frame, history_frame)
