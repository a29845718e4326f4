"""Confirmation (``hydra.sweeper.confirm: {top: k, seeds: s}``): after the search, its k best points and the CE-only
baseline (``kd_ratio=0`` at the best point's other values) are trained again with s fresh training seeds, as trials
marked ``confirm`` (pruning off; warm workers and the teacher cache apply as to any trial), and the sweep's answer
is the verdict on them: per point the mean of the objective over seeds with a 95% interval (Student's t), the paired
difference (same seeds) to the CE-only baseline and to the best point, and one line.

Its place in the sweep: :func:`plan` once no search trial runs and no more will start (the plan is written to
``sweep.json`` before any of its trials is asked, so a resumed controller continues the same plan);
:func:`next_item` the next confirmation trial to ask; :func:`verdict` from the trials' results as recorded.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from kdsweep.config.schema import ConfigError

SEED_BASE = 1000
"""Confirmation seeds are ``train.seed`` = 1000, 1001, …: not the search's (0 unless a user sets one)."""
KD_RATIO_KEYS = ("kd_ratio", "loss.kd_ratio")
BASELINE = "ce_only"


@dataclass(frozen=True)
class ConfirmSettings:
    """``hydra.sweeper.confirm``, validated."""

    top: int
    seeds: int
    objective: str

    @classmethod
    def of(cls, raw: dict[str, Any] | None, objectives: tuple[str, ...], trial_limit: float) -> "ConfirmSettings | None":
        if not raw or not raw.get("top"):  # top 0 (the sweeper's default): no confirmation
            return None
        unknown = set(raw) - {"top", "seeds", "objective"}
        if unknown:
            raise ConfigError(f"hydra.sweeper.confirm has unknown keys {sorted(unknown)}; use top, seeds, objective")
        top, seeds = int(raw.get("top", 1)), int(raw.get("seeds", 3))
        if top < 0 or seeds < 2:
            raise ConfigError(f"hydra.sweeper.confirm={dict(raw)}: top must be >= 1 (0: none) and seeds >= 2 "
                              "(an interval needs two seeds)")
        if len(objectives) > 1 and not raw.get("objective"):
            raise ConfigError(f"hydra.sweeper.confirm of a study with several objectives {list(objectives)} must "
                              f"name the one it ranks on: hydra.sweeper.confirm.objective={objectives[0]}")
        objective = raw.get("objective") or objectives[0]
        if objective not in objectives:
            raise ConfigError(f"hydra.sweeper.confirm.objective={objective!r} is not one of the study's objectives "
                              f"{list(objectives)}")
        if top > trial_limit:
            raise ConfigError(f"hydra.sweeper.confirm.top={top} is more than the sweep's {trial_limit:g} trials "
                              f"(hydra.sweeper.n_trials): lower top or raise n_trials")
        return cls(top, seeds, objective)

    @property
    def trials(self) -> int:
        """How many confirmation trials: every seed of the top points and of the CE-only baseline."""
        return (self.top + 1) * self.seeds


def _signed(value: float, direction: str) -> float:
    return value if direction == "minimize" else -value


def plan(trials: list[dict[str, Any]], confirm: ConfirmSettings, objectives: tuple[str, ...],
         directions: tuple[str, ...]) -> dict[str, Any]:
    """The confirmation's points from the search's completed trials (the k best distinct points, best first, and the
    baseline) and its items (one per point and seed, in the order they are asked)."""
    index = objectives.index(confirm.objective)
    direction = directions[index]
    done = [t for t in trials if t["state"] == "COMPLETE" and not t.get("confirm")]
    done.sort(key=lambda t: _signed(t["values"][index], direction))
    points, seen = [], set()
    for t in done:
        key = tuple(sorted(t["params"].items()))
        if key not in seen:
            seen.add(key)
            points.append({"label": f"top{len(points) + 1}", "params": dict(t["params"]), "search_trial": t["number"]})
        if len(points) == confirm.top:
            break
    if points:
        best = points[0]["params"]
        key = next((k for k in KD_RATIO_KEYS if k in best), "kd_ratio")
        points.append({"label": BASELINE, "params": {**best, key: 0.0}, "search_trial": None})
    items = [{"label": p["label"], "seed": SEED_BASE + s} for p in points for s in range(confirm.seeds)]
    return {"objective": confirm.objective, "direction": direction, "points": points, "items": items}


def next_item(confirmation: dict[str, Any], trials: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first item of the plan no trial runs yet (None: every one was asked)."""
    asked = {(t["confirm"]["label"], t["confirm"]["seed"]) for t in trials if t.get("confirm")}
    return next((i for i in confirmation["items"] if (i["label"], i["seed"]) not in asked), None)


def _interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% Student-t interval (nan with fewer than two values)."""
    from scipy.stats import t as student_t

    mean = statistics.fmean(values) if values else math.nan
    if len(values) < 2:
        return mean, math.nan
    return mean, float(student_t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))


def _paired(a: dict[int, float], b: dict[int, float]) -> tuple[float, float, int]:
    """Mean ± 95% half-width of a − b over the seeds both have, and how many."""
    seeds = sorted(set(a) & set(b))
    mean, half = _interval([a[s] - b[s] for s in seeds])
    return mean, half, len(seeds)


def _point_text(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def verdict(confirmation: dict[str, Any], trials: list[dict[str, Any]], objectives: tuple[str, ...]) -> dict[str, Any]:
    """Per point: mean ± 95% over its seeds, paired differences to CE-only and to the best; and the verdict line."""
    index = objectives.index(confirmation["objective"])
    direction = confirmation["direction"]
    by_label: dict[str, dict[int, float]] = {p["label"]: {} for p in confirmation["points"]}
    for t in trials:
        if t.get("confirm") and t["state"] == "COMPLETE":
            by_label[t["confirm"]["label"]][t["confirm"]["seed"]] = t["values"][index]
    rows = []
    for p in confirmation["points"]:
        mean, half = _interval(list(by_label[p["label"]].values()))
        rows.append({**p, "seeds": sorted(by_label[p["label"]]), "mean": mean, "ci95": half})
    ranked = sorted((r for r in rows if r["label"] != BASELINE and r["seeds"]),
                    key=lambda r: _signed(r["mean"], direction))
    if not ranked:
        return {"points": rows, "best": None, "line": "no confirmation trial completed: no verdict"}
    best = ranked[0]
    for r in rows:
        for ref, name in ((by_label.get(BASELINE, {}), "vs_ce_only"), (by_label[best["label"]], "vs_best")):
            mean, half, n = _paired(by_label[r["label"]], ref)
            r[name] = {"mean": mean, "ci95": half, "seeds": n}
    line = f"{_point_text(best['params'])}: {best['mean']:.4f} ± {best['ci95']:.4f} over {len(best['seeds'])} seeds"
    vs = best["vs_ce_only"]
    gain = -_signed(vs["mean"], direction)  # > 0: the point is better than CE-only
    if math.isnan(vs["ci95"]):
        line += "; CE-only not confirmed"
    elif gain - vs["ci95"] > 0:
        line += f"; beats CE-only by {gain:.4f} ± {vs['ci95']:.4f}"
    elif gain + vs["ci95"] < 0:
        line += f"; CE-only beats it by {-gain:.4f} ± {vs['ci95']:.4f}"
    else:
        line += f"; not distinguishable from CE-only ({gain:+.4f} ± {vs['ci95']:.4f})"
    if len(ranked) > 1:
        second = ranked[1]["vs_best"]
        worse = _signed(second["mean"], direction)
        line += ("; 2nd best is not distinguishable" if math.isnan(second["ci95"]) or worse - second["ci95"] <= 0
                 else f"; 2nd best is worse by {worse:.4f} ± {second['ci95']:.4f}")
    return {"points": rows, "best": best["label"], "line": line}


__all__ = ["BASELINE", "ConfirmSettings", "SEED_BASE", "next_item", "plan", "verdict"]
