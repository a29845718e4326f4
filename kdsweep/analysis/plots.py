"""Figures of a sweep for notebooks and reports; each function takes a :class:`Sweep` and returns a matplotlib
Figure (not registered with pyplot, so nothing leaks or shows twice; ``fig.savefig(path)`` to keep it).

COMPLETE trials are dots coloured by the objective, PRUNED trials grey crosses at their last eval, the best
trial a star. A figure that lacks the data it needs (one trial, no second objective) says so in its body.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure

from kdsweep.analysis.sweep import Sweep
from kdsweep.config.schema import ConfigError

PAIRWISE = ("kd_ratio", "lr", "lora_rank")
PRUNED_STYLE = {"marker": "x", "color": "0.55", "s": 40, "label": "pruned (last eval)"}
BEST_STYLE = {"marker": "*", "s": 260, "facecolor": "none", "edgecolor": "crimson", "linewidth": 1.5, "label": "best"}


def note(title: str, text: str) -> Figure:
    """A figure that only says why there is nothing to draw."""
    fig = Figure(figsize=(6, 2.5), layout="constrained")
    ax = fig.add_subplot()
    ax.set_axis_off()
    ax.set_title(title)
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, transform=ax.transAxes)
    return fig


def _objective(sweep: Sweep, objective: str | None) -> tuple[str, str, str]:
    """(metric, trials column, direction) of ``objective`` (default: the first)."""
    name = objective or sweep.objectives[0]
    if name not in sweep.objectives:
        raise ConfigError(f"objective {name!r} is not one of the sweep's objectives {sweep.objectives}")
    return name, f"objective.{name}", sweep.directions[sweep.objectives.index(name)]


def _pruned_last(sweep: Sweep, metric: str) -> pd.DataFrame:
    """The PRUNED trials with their last eval of ``metric`` (what the pruner saw last), as column ``last``."""
    pruned = sweep.trials[sweep.trials["state"] == "PRUNED"]
    evals = sweep.history[(sweep.history["kind"] == "eval") & sweep.history["trial"].isin(pruned["number"])]
    if evals.empty or metric not in evals:
        return pruned.assign(last=pd.Series(dtype=float))
    last = evals.sort_values("step").groupby("trial")[metric].last()
    return pruned.assign(last=pruned["number"].map(last))


def _axis(ax: Any, spec: dict[str, Any], values: pd.Series, which: str = "x") -> pd.Series:
    """Put a searched parameter on an axis: log scale for log spaces, categories at positions 0..n-1."""
    label = (ax.set_xlabel if which == "x" else ax.set_ylabel)
    label(spec["key"])
    if spec["kind"] == "categorical":
        choices = list(spec["choices"])
        (ax.set_xticks if which == "x" else ax.set_yticks)(range(len(choices)), [str(c) for c in choices])
        (ax.set_xlim if which == "x" else ax.set_ylim)(-0.5, len(choices) - 0.5)
        return values.map(lambda v: choices.index(v) if v in choices else np.nan)
    if spec.get("log"):
        (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    return values.astype(float)


def objective_vs_params(sweep: Sweep, objective: str | None = None) -> Figure:
    """The objective against each searched parameter, one panel per parameter."""
    metric, column, _ = _objective(sweep, objective)
    if not sweep.space:
        return note("objective vs parameters", "the sweep searched no parameters")
    done, pruned, best = sweep.complete(), _pruned_last(sweep, metric), sweep.best_number()
    fig = Figure(figsize=(4.2 * len(sweep.space), 3.8), layout="constrained")
    axes = fig.subplots(1, len(sweep.space), sharey=True, squeeze=False)[0]
    for ax, spec in zip(axes, sweep.space):
        x = f"param.{spec['key']}"
        ax.scatter(_axis(ax, spec, done[x]), done[column], label="complete")
        if not pruned.empty:
            ax.scatter(_axis(ax, spec, pruned[x]), pruned["last"], **PRUNED_STYLE)
        if best is not None:
            b = done[done["number"] == best]
            ax.scatter(_axis(ax, spec, b[x]), b[column], **BEST_STYLE)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(metric)
    axes[0].legend(fontsize="small")
    fig.suptitle(f"{sweep.study_name}: {metric} vs each parameter ({len(done)} complete, {len(pruned)} pruned)")
    return fig


def pairwise(sweep: Sweep, params: tuple[str, ...] | None = None, objective: str | None = None) -> Figure:
    """Each pair of parameters (default: kd_ratio, lr, lora_rank where searched), trials coloured by the objective."""
    metric, column, direction = _objective(sweep, objective)
    specs = {p["key"]: p for p in sweep.space}
    keys = ([k for k in (params or PAIRWISE) if k in specs] if params or any(k in specs for k in PAIRWISE)
            else list(specs))
    if len(keys) < 2:
        return note("parameter pairs", f"needs two searched parameters; this sweep searched {list(specs) or 'none'}")
    pairs = list(itertools.combinations(keys, 2))
    done, pruned = sweep.complete(), _pruned_last(sweep, metric)
    fig = Figure(figsize=(4.4 * len(pairs), 4.0), layout="constrained")
    axes = fig.subplots(1, len(pairs), squeeze=False)[0]
    points = None
    for ax, (a, b) in zip(axes, pairs):
        if not pruned.empty:
            ax.scatter(_axis(ax, specs[a], pruned[f"param.{a}"]), _axis(ax, specs[b], pruned[f"param.{b}"], "y"),
                       **PRUNED_STYLE)
        points = ax.scatter(_axis(ax, specs[a], done[f"param.{a}"]), _axis(ax, specs[b], done[f"param.{b}"], "y"),
                            c=done[column], cmap="viridis_r" if direction == "minimize" else "viridis", s=60,
                            edgecolor="k", linewidth=0.4)
        ax.grid(alpha=0.3)
    if points is not None and len(done):
        fig.colorbar(points, ax=list(axes), label=f"{metric} ({direction})")
    if not pruned.empty:
        axes[0].legend(fontsize="small")
    fig.suptitle(f"{sweep.study_name}: parameter pairs, coloured by {metric}")
    return fig


def learning_curves(sweep: Sweep, metric: str = "student_ce", kind: str = "eval") -> Figure:
    """``metric`` of every trial against the optimizer step; pruned trials dashed, ending in a cross."""
    history = sweep.history[sweep.history["kind"] == kind]
    if history.empty or metric not in history:
        return note("learning curves", f"no {kind} rows with {metric} were logged")
    fig = Figure(figsize=(8, 4.8), layout="constrained")
    ax = fig.add_subplot()
    best = sweep.best_number()
    states = dict(zip(sweep.trials["number"], sweep.trials["state"]))
    for trial, rows in history.groupby("trial"):
        rows = rows.dropna(subset=[metric]).sort_values("step")
        state = states.get(trial, "?")
        style = {"PRUNED": dict(linestyle="--", alpha=0.7), "FAIL": dict(linestyle=":", color="0.6")}.get(state, {})
        if trial == best:
            style = dict(linewidth=2.6, color="crimson", zorder=3)
        (line,) = ax.plot(rows["step"], rows[metric], marker=".", label=f"trial {trial} ({state.lower()})", **style)
        if state == "PRUNED" and len(rows):
            ax.scatter(rows["step"].iloc[-1:], rows[metric].iloc[-1:], marker="x", s=80, color=line.get_color(),
                       zorder=4)
            ax.annotate(f"pruned @ {rows['step'].iloc[-1]}", (rows["step"].iloc[-1], rows[metric].iloc[-1]),
                        textcoords="offset points", xytext=(4, 4), fontsize="x-small", color=line.get_color())
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"{kind} {metric}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncol=2 if history["trial"].nunique() > 8 else 1)
    ax.set_title(f"{sweep.study_name}: {kind} {metric} per trial"
                 + (f" (best: trial {best})" if best is not None else ""))
    return fig


def importances(sweep: Sweep, objective: str | None = None) -> Figure:
    """Optuna's parameter importances for the objective (needs the study and two COMPLETE trials)."""
    import optuna

    metric, _, _ = _objective(sweep, objective)
    if sweep.study is None:
        return note("parameter importances", "the study was not loaded (load_sweep(..., study=True))")
    done = sweep.complete()
    if len(done) < 2 or not sweep.space:
        return note("parameter importances", f"needs at least 2 COMPLETE trials ({len(done)} so far)")
    index = sweep.objectives.index(metric)
    target = (lambda t: t.values[index]) if len(sweep.objectives) > 1 else None
    scores = optuna.importance.get_param_importances(sweep.study, target=target)
    fig = Figure(figsize=(6, 0.5 + 0.6 * max(1, len(scores))), layout="constrained")
    ax = fig.add_subplot()
    names = list(scores)[::-1]
    ax.barh(names, [scores[n] for n in names])
    for y, name in enumerate(names):
        ax.text(scores[name], y, f" {scores[name]:.2f}", va="center", fontsize="small")
    ax.set_xlim(0, 1.1)
    ax.set_xlabel(f"importance for {metric}")
    ax.set_title(f"{sweep.study_name}: what mattered ({len(done)} complete trials)")
    return fig


def parallel_coordinates(sweep: Sweep, objective: str | None = None) -> Figure:
    """Each COMPLETE trial as a line through its parameters and the objective (axes scaled to [0, 1], log
    spaces in log, categories evenly spaced), coloured by the objective."""
    metric, column, direction = _objective(sweep, objective)
    done = sweep.complete()
    if done.empty or not sweep.space:
        return note("parallel coordinates", "needs a COMPLETE trial and a searched parameter")
    axes_values, labels = [], []
    for spec in sweep.space:
        scaled, ticks = _scaled(spec, done[f"param.{spec['key']}"])
        axes_values.append(scaled)
        labels.append((spec["key"], ticks))
    objective_spec = {"key": metric, "kind": "float", "low": done[column].min(), "high": done[column].max()}
    scaled, ticks = _scaled(objective_spec, done[column])
    axes_values.append(scaled)
    labels.append((metric, ticks))
    fig = Figure(figsize=(1.9 * len(labels) + 2, 4.2), layout="constrained")
    ax = fig.add_subplot()
    data = np.vstack(axes_values).T
    values = done[column].to_numpy(dtype=float)
    span = (values.max() - values.min()) or 1.0
    colors = colormaps["viridis_r" if direction == "minimize" else "viridis"]
    for row, value in zip(data, values):
        ax.plot(range(len(labels)), row, color=colors((value - values.min()) / span), alpha=0.85, marker="o")
    for i, (name, (low, high)) in enumerate(labels):
        ax.axvline(i, color="0.3", linewidth=0.8)
        ax.text(i, -0.06, low, ha="center", va="top", fontsize="x-small")
        ax.text(i, 1.06, high, ha="center", va="bottom", fontsize="x-small")
    ax.set_xticks(range(len(labels)), [name for name, _ in labels])
    ax.set_yticks([])
    ax.set_ylim(-0.15, 1.15)
    fig.colorbar(ScalarMappable(Normalize(values.min(), values.max()), cmap=colors), ax=ax,
                 label=f"{metric} ({direction})")
    ax.set_title(f"{sweep.study_name}: parallel coordinates ({len(done)} complete trials)")
    return fig


def _scaled(spec: dict[str, Any], values: pd.Series) -> tuple[np.ndarray, tuple[str, str]]:
    """Values mapped to [0, 1] on the parameter's own scale, and the labels of the two ends."""
    if spec["kind"] == "categorical":
        choices = list(spec["choices"])
        n = max(1, len(choices) - 1)
        return values.map(lambda v: choices.index(v) / n).to_numpy(dtype=float), (str(choices[0]), str(choices[-1]))
    low, high, v = float(spec["low"]), float(spec["high"]), values.to_numpy(dtype=float)
    if spec.get("log") and low > 0:
        low, high, v = math.log10(low), math.log10(high), np.log10(v)
        ends = (f"{10 ** low:.3g}", f"{10 ** high:.3g}")
    else:
        ends = (f"{low:.3g}", f"{high:.3g}")
    return (v - low) / ((high - low) or 1.0), ends


def pareto_front(sweep: Sweep) -> Figure:
    """The two objectives of a multi-objective study: every COMPLETE trial, the Pareto-optimal ones joined."""
    if len(sweep.objectives) != 2:
        raise ConfigError(f"the Pareto front needs a study with two objectives; {sweep.study_name} has "
                          f"{sweep.objectives}")
    (x, y), (dx, dy) = sweep.objective_columns, sweep.directions
    done, front = sweep.complete(), sweep.pareto().sort_values(sweep.objective_columns[0])
    fig = Figure(figsize=(6.5, 5), layout="constrained")
    ax = fig.add_subplot()
    ax.scatter(done[x], done[y], color="0.6", label="complete")
    ax.plot(front[x], front[y], marker="o", color="crimson", label="Pareto front")
    for _, t in done.iterrows():
        ax.annotate(str(t["number"]), (t[x], t[y]), textcoords="offset points", xytext=(4, 4), fontsize="x-small")
    ax.set_xlabel(f"{sweep.objectives[0]} ({dx})")
    ax.set_ylabel(f"{sweep.objectives[1]} ({dy})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(f"{sweep.study_name}: Pareto front ({len(front)} of {len(done)} complete trials)")
    return fig


def confirmation(sweep: Sweep) -> Figure:
    """The confirmed points (``hydra.sweeper.confirm``): each seed's objective as a dot, the mean with its 95%
    interval as a bar, best first, CE-only last; the verdict line as the title."""
    points = sweep.confirmation()
    if points.empty:
        return note("confirmation", "this sweep has no verdict: set hydra.sweeper.confirm (top, seeds) to have "
                                    "its top points and CE-only trained again with fresh seeds")
    runs = sweep.trials[sweep.trials["confirm.label"].notna() & (sweep.trials["state"] == "COMPLETE")]
    column = f"objective.{sweep.manifest['confirmation']['objective']}"
    fig = Figure(figsize=(7, 1.2 + 0.7 * len(points)), layout="constrained")
    ax = fig.add_subplot()
    for y, (_, p) in enumerate(points.iterrows()):
        seeds = runs[runs["confirm.label"] == p["label"]][column]
        ax.scatter(seeds, [y] * len(seeds), color="0.45", s=18, zorder=3)
        ax.errorbar(p["mean"], y, xerr=0.0 if pd.isna(p["ci95"]) else p["ci95"], fmt="o", color="crimson",
                    capsize=4, zorder=4)
    labels = [f"{p['label']}: " + " ".join(f"{k}={_short(p[f'param.{k}'])}" for k in sweep.params)
              for _, p in points.iterrows()]
    ax.set_yticks(range(len(points)), labels, fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel(f"{column.split('.', 1)[1]} over seeds (mean ± 95%)")
    ax.grid(alpha=0.3, axis="x")
    ax.set_title(sweep.verdict, fontsize="small", wrap=True)
    return fig


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
