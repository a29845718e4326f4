"""A sweep directory as tidy DataFrames: one row per trial (manifest + run record + study), every logged step.

    sweep = load_sweep("outputs/sweeps/2026-11-29/19-36-10")
    sweep.trials      number, state, objective.<name>, param.<key>, started, ended, duration_s, run_dir, ...
    sweep.history     trial, kind (train | eval), step, then the metrics of that row (long format)
    sweep.study       the optuna Study (importances, Optuna's own plots)

``trials`` and ``history`` join on the trial number (``trials.number`` = ``history.trial``), as do the W&B runs
of :func:`kdsweep.analysis.load_wandb_runs`.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from kdsweep.analysis.runs import read_metrics, read_record
from kdsweep.config.schema import ConfigError
from kdsweep.evaluation.report import EVAL_JSON
from kdsweep.sweep.confirm import BASELINE

EVAL_METRICS = ("student_ce", "kl", "teacher_ce")
FINISHED = ("COMPLETE", "PRUNED")  # a trial in these states must have its run record


@dataclass
class Sweep:
    sweep_dir: Path
    manifest: dict[str, Any]
    """sweep.json as saved (settings, space, base_overrides, trials)."""
    trials: pd.DataFrame
    """One row per trial, by number: state (the manifest's; ``optuna_state`` the study's), ``objective.<name>``
    (NaN unless COMPLETE), ``param.<key>``, started/ended (UTC) and duration_s (first start to end, requeues
    included), attempts, the run record's status and steps, pruned_step and last_value (the last value reported
    to the pruner), ``eval_after.<metric>``, reason (FAIL), run_dir, pid or slurm_job_id (a warm worker's trial: its
    worker, and the worker's SLURM job), host, world_size, wandb_run_id, and for a confirmation's re-run its
    ``confirm.label`` (top1, …, ce_only) and ``confirm.seed`` (NA for the search's trials)."""
    history: pd.DataFrame
    """Every row of every trial's metrics.jsonl, in order: trial, kind (train | eval), step, the metrics."""
    study: Any
    """The optuna Study, or None when loaded with ``study=False``."""

    @property
    def study_name(self) -> str:
        return self.manifest["study_name"]

    @property
    def objectives(self) -> list[str]:
        return list(self.manifest["settings"]["objectives"])

    @property
    def directions(self) -> list[str]:
        return list(self.manifest["settings"]["directions"])

    @property
    def objective_columns(self) -> list[str]:
        return [f"objective.{o}" for o in self.objectives]

    @property
    def space(self) -> list[dict[str, Any]]:
        """The searched parameters as the manifest describes them (key, kind, low, high, log, choices)."""
        return list(self.manifest["space"])

    @property
    def params(self) -> list[str]:
        return [p["key"] for p in self.space]

    def complete(self) -> pd.DataFrame:
        """The search's COMPLETE trials (a confirmation's re-runs are not the search's: :meth:`confirmation`)."""
        return self.trials[(self.trials["state"] == "COMPLETE") & self.trials["confirm.label"].isna()]

    @property
    def verdict(self) -> str | None:
        """The confirmation's verdict line (``hydra.sweeper.confirm``), or None when the sweep had none (yet)."""
        return (self.manifest.get("verdict") or {}).get("line")

    def confirmation(self) -> pd.DataFrame:
        """One row per confirmed point (the search's top points and CE-only): label, ``param.<key>``, seeds (how
        many completed), mean and ci95 (the 95% half-width over seeds) of the objective it ranks on, on ``split``
        (test; eval for a sweep planned without one), its mean on the eval split (``eval_mean``), and the paired
        differences to CE-only and to the best point (``vs_ce_only.mean`` / ``.ci95``, ``vs_best.*``), as the
        verdict computed them, and each second measure's mean over the seeds (``<measure>.mean``: the best point's
        and CE-only's, ``hydra.sweeper.confirm.also``); empty without a verdict."""
        verdict = self.manifest.get("verdict") or {}
        also = verdict.get("also", {})
        columns = ["label", *(f"param.{k}" for k in self.params), "seeds", "split", "mean", "ci95", "eval_mean",
                   "vs_ce_only.mean", "vs_ce_only.ci95", "vs_best.mean", "vs_best.ci95", *(f"{m}.mean" for m in also)]
        second = {verdict.get("best"): "mean", BASELINE: "ce_only"}  # the rows a second measure scores
        rows = [{"label": p["label"], **{f"param.{k}": p["params"].get(k) for k in self.params},
                 "seeds": len(p["seeds"]), "split": p.get("split", "eval"), "mean": p["mean"], "ci95": p["ci95"],
                 "eval_mean": p.get("eval_mean", p["mean"]),
                 **{f"{ref}.{x}": (p.get(ref) or {}).get(x)
                    for ref in ("vs_ce_only", "vs_best") for x in ("mean", "ci95")},
                 **{f"{m}.mean": a.get(second[p["label"]]) if p["label"] in second else None for m, a in also.items()}}
                for p in verdict.get("points", [])]
        return pd.DataFrame.from_records(rows, columns=columns)

    def evaluation(self) -> pd.DataFrame:
        """The sweep's last ``kdsweep eval <sweep dir>`` table (``eval.json``), one row per task and model: task,
        name (the confirmed point's and CE-only's seeds, the base student), metric, value (a mean over seeds), the
        95% half_width, stderr, models (seeds), items, and vs_base / vs_base_se (the difference to the base, in
        standard errors); empty when the sweep was never evaluated."""
        columns = ["task", "name", "metric", "value", "half_width", "stderr", "models", "items", "vs_base",
                   "vs_base_se"]
        path = self.sweep_dir / EVAL_JSON
        rows = json.loads(path.read_text())["rows"] if path.exists() else []
        return pd.DataFrame.from_records([{c: r.get(c) for c in columns} for r in rows], columns=columns)

    def best_number(self) -> int | None:
        """The best COMPLETE trial on the first objective (for two objectives: the Pareto trial best on it)."""
        done = self.pareto() if len(self.objectives) > 1 else self.complete()
        if done.empty:
            return None
        column, direction = self.objective_columns[0], self.directions[0]
        ordered = done.sort_values([column, "number"], ascending=[direction == "minimize", True])
        return int(ordered["number"].iloc[0])

    def pareto(self) -> pd.DataFrame:
        """The COMPLETE trials that no other COMPLETE trial dominates (all objectives at least as good, one
        better), in trial order. With one objective: the best trial(s)."""
        done = self.complete()
        signs = [1.0 if d == "minimize" else -1.0 for d in self.directions]
        costs = done[self.objective_columns].to_numpy(dtype=float) * signs
        keep = [not any((other <= mine).all() and (other < mine).any() for other in costs) for mine in costs]
        return done[pd.Series(keep, index=done.index, dtype=bool)]

    def reproduce_command(self, number: int | None = None, run_dir: str | Path | None = None) -> str:
        """The shell command that reruns trial ``number`` (default: the best) as a plain job: the sweep's fixed
        overrides, the trial's parameters, a fresh output directory; it does not report to the study."""
        number = self.best_number() if number is None else number
        if number is None:
            raise ConfigError(f"{self.sweep_dir} has no COMPLETE trial to reproduce")
        entry = self.manifest["trials"].get(str(number))
        if entry is None:
            raise ConfigError(f"trial {number} is not in {self.sweep_dir}")
        run_dir = run_dir or self.sweep_dir / "reproduce" / f"trial-{number}"
        # the parameters written exactly as the controller wrote them on the trial's own command line
        args = [*self.manifest["base_overrides"], *(f"{k}={v}" for k, v in entry["params"].items()),
                f"hydra.run.dir={run_dir}"]
        return " ".join(["python", "-m", "kdsweep", *(shlex.quote(a) for a in args)])


def load_sweep(sweep_dir: str | Path, *, study: bool = True) -> Sweep:
    """Read ``sweep_dir`` (sweep.json, each trial's run.json and metrics.jsonl) and, unless ``study=False``,
    its Optuna study (any storage; a database password comes from KDSWEEP_STORAGE_URL)."""
    sweep_dir = Path(sweep_dir).resolve()
    manifest = read_manifest(sweep_dir)
    entries = sorted(manifest["trials"].values(), key=lambda e: int(e["number"]))
    records, histories = {}, []
    for entry in entries:
        n, run_dir = int(entry["number"]), trial_dir(sweep_dir, entry)
        record = read_record(run_dir)
        if record is None and entry.get("state") in FINISHED:
            raise ConfigError(f"trial {n} is {entry['state']} but {run_dir / 'run.json'} is missing; "
                              "was its run directory moved or deleted?")
        records[n] = record or {}
        histories.append(pd.DataFrame.from_records(read_metrics(run_dir)).assign(trial=n))
    optuna_study = _load_study(sweep_dir, manifest) if study else None
    trials = _trials_frame(sweep_dir, manifest, entries, records, optuna_study)
    return Sweep(sweep_dir, manifest, trials, _history_frame(histories), optuna_study)


def read_manifest(sweep_dir: Path) -> dict[str, Any]:
    path = sweep_dir / "sweep.json"
    if not sweep_dir.is_dir():
        raise ConfigError(f"{sweep_dir} does not exist or is not a directory; pass a sweep directory (hydra.sweep.dir)")
    if not path.exists():
        raise ConfigError(f"{sweep_dir} is not a kdsweep sweep directory (no sweep.json)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e})") from None
    missing = [k for k in ("study_name", "settings", "space", "base_overrides", "trials") if k not in data]
    if missing:
        raise ConfigError(f"{path} is not a kdsweep manifest (no {', '.join(missing)})")
    return data


def trial_dir(sweep_dir: Path, entry: dict[str, Any]) -> Path:
    """The trial's directory: ``<sweep_dir>/<n>`` where the controller puts it, so that a copied sweep (a CI
    artifact, an archive) reads its own trials; else the path the manifest saved."""
    local = sweep_dir / str(entry["number"])
    return local if local.is_dir() else Path(entry.get("run_dir") or local)


def _load_study(sweep_dir: Path, manifest: dict[str, Any]) -> Any:
    import optuna

    from kdsweep.sweep.manifest import Manifest, connect_url
    from kdsweep.sweep.study import make_storage

    settings = Manifest(sweep_dir / "sweep.json", manifest).settings
    url = connect_url(settings, sweep_dir)
    for prefix in ("sqlite:///", "journal://"):  # opening a missing file would create an empty study store
        if url.startswith(prefix) and not Path(url[len(prefix):]).exists():
            raise ConfigError(f"the study storage of {sweep_dir} ({url}) does not exist")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        return optuna.load_study(study_name=manifest["study_name"], storage=make_storage(url))
    except KeyError:
        raise ConfigError(f"study {manifest['study_name']!r} is not in {url}") from None


def _trials_frame(sweep_dir: Path, manifest: dict[str, Any], entries: list[dict[str, Any]],
                  records: dict[int, dict[str, Any]], study: Any) -> pd.DataFrame:
    objectives = manifest["settings"]["objectives"]
    keys = [p["key"] for p in manifest["space"]]
    frozen = {t.number: t for t in study.get_trials(deepcopy=False)} if study is not None else {}
    rows = []
    for entry in entries:
        n = int(entry["number"])
        record, job, ft = records[n], entry.get("job") or {}, frozen.get(n)
        values = entry.get("values") or [None] * len(objectives)
        started, ended = entry.get("started"), entry.get("ended")
        env, wandb = record.get("environment") or {}, record.get("wandb") or {}
        last_step = ft.last_step if ft is not None else None
        pruned = entry.get("state") == "PRUNED"
        row = {
            "number": n,
            "state": entry.get("state"),
            **{f"objective.{o}": v for o, v in zip(objectives, values)},
            **{f"param.{k}": entry.get("params", {}).get(k) for k in keys},
            "started": started, "ended": ended,
            "duration_s": ended - started if started is not None and ended is not None else None,
            "attempts": entry.get("attempts"),
            "status": record.get("status"),
            "steps": record.get("steps"),
            "pruned_step": (record.get("steps") if last_step is None else last_step) if pruned else None,
            "last_value": ft.intermediate_values[last_step] if last_step is not None else None,
            **{f"eval_after.{m}": (record.get("eval_after") or {}).get(m) for m in EVAL_METRICS},
            "reason": entry.get("reason") or None,
            "confirm.label": (entry.get("confirm") or {}).get("label"),
            "confirm.seed": (entry.get("confirm") or {}).get("seed"),
            "run_dir": str(trial_dir(sweep_dir, entry)),
            "pid": job.get("pid"),
            "slurm_job_id": (job.get("slurm_job_id")
                             or ((record.get("environment") or {}).get("slurm") or {}).get("job_id")),
            "worker": job.get("worker"),
            "host": env.get("host"),
            "world_size": record.get("world_size"),
            "wandb_run_id": wandb.get("id"),
            "optuna_state": ft.state.name if ft is not None else None,
        }
        rows.append(row)
    frame = pd.DataFrame.from_records(rows, columns=_columns(objectives, keys))
    for column in ("started", "ended"):
        frame[column] = pd.to_datetime(frame[column], unit="s", utc=True)
    floats = [c for c in frame.columns if c.startswith(("objective.", "eval_after."))] + ["duration_s", "last_value"]
    frame[floats] = frame[floats].astype(float)
    for column in ("pruned_step", "steps", "pid", "world_size", "attempts", "confirm.seed"):
        frame[column] = frame[column].astype("Int64")
    return frame


def _columns(objectives: list[str], keys: list[str]) -> list[str]:
    return ["number", "state", *(f"objective.{o}" for o in objectives), *(f"param.{k}" for k in keys),
            "started", "ended", "duration_s", "attempts", "status", "steps", "pruned_step", "last_value",
            *(f"eval_after.{m}" for m in EVAL_METRICS), "reason", "confirm.label", "confirm.seed", "run_dir", "pid",
            "slurm_job_id", "worker", "host", "world_size", "wandb_run_id", "optuna_state"]


def _history_frame(parts: list[pd.DataFrame]) -> pd.DataFrame:
    parts = [p for p in parts if not p.empty]
    if not parts:
        return pd.DataFrame(columns=["trial", "kind", "step"])
    frame = pd.concat(parts, ignore_index=True)
    first = ["trial", "kind", "step"]
    return frame[first + [c for c in frame.columns if c not in first]]
