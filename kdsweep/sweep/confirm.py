"""Confirmation (``hydra.sweeper.confirm: {top: k, seeds: s, baseline_trials: b}``): after the search, its k best
points and the CE-only baseline are trained again with s fresh seeds, as trials marked ``confirm`` (pruning off; warm
workers apply as to any trial), and the sweep's answer is the verdict on them.

- **Unbiased and independent** (:data:`UNBIASED`): each seed's trial trains with the live teacher whatever the
  search read (a ``sample`` or ``topk`` cache's bias, and its draws, stay with the search), changes every random
  source it has (``train.seed``: order, init, dropout; ``rollout.seed``: generation), and is scored on the data's
  test split, which no search trial reads (``data.test_fraction``); the search's eval-split values are kept beside.

- **The reported point is fixed before its confirmation**: the search's best (``top1``); the confirmation measures
  it, it does not re-pick it by the means it then tests it with.
- **A fair baseline**: the CE-only arm trains on the gold labels alone (``loss.kd_ratio=0``, ``rollout.lmbda=0``, no
  ``seq_kd``: no teacher in training; the evaluations still read it), at the best point's other values, and at a
  learning rate of its own: when the search space has one, b CE-only trials (``ce_lr1`` …, log-uniform over its
  range, drawn from the sweeper's seed) run first, and the best of them by the search's objective is the baseline's.
- **Sound statistics**: per point the mean over its seeds with a 95% Student-t interval; each comparison the line
  makes (``top1`` against CE-only, every other top point against ``top1``) paired on the seeds both completed,
  printed with its unadjusted 95% interval and decided after Holm's correction across the comparisons made; with
  the smallest difference its seeds could detect (two-sided 5%, power 80%) and, when it is not distinguishable, how
  many more seeds would resolve the difference seen. At least 3 seeds.

Its place in the sweep: :func:`plan` once no search trial runs and no more will start (the plan is written to
``sweep.json`` before any of its trials is asked, so a resumed controller continues the same plan);
:func:`settle_baseline` once the CE-only learning-rate trials have ended; :func:`next_item` the next confirmation
trial to ask (seed by seed, CE-only right after top1: a budget that cuts the confirmation short leaves the best point
and the baseline paired on the seeds that ran); :func:`verdict` from the trials' results as recorded.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import Any

from kdsweep.config.schema import ConfigError
from kdsweep.evaluation.downstream import task_of
from kdsweep.sweep.manifest import FINAL
from kdsweep.sweep.study import OBJECTIVES

SEED_BASE = 1000
"""Confirmation seeds are ``train.seed`` = ``rollout.seed`` = 1000, 1001, …: not the search's (0 unless set)."""
KD_RATIO_KEYS = ("kd_ratio", "loss.kd_ratio")
LMBDA_KEYS = ("lmbda", "rollout.lmbda")
LR_KEYS = ("lr", "optim.lr")
CE_ONLY = {"loss.kd_ratio": 0.0, "rollout.lmbda": 0.0, "rollout.seq_kd": False}
"""What makes the baseline CE-only whatever the search or its base overrides set: every override of the sections'
own keys, after theirs on the command line (so they win over a top-level knob's interpolation and a user's own)."""
UNBIASED = ("teacher.logits=live", "train.eval_test=true")
"""What a confirmation seed's trial adds to its point: the live teacher, and its score on the test split."""
BASELINE = "ce_only"
BASELINE_SEARCH = "ce_lr"
"""Labels ``ce_lr1`` … of the CE-only learning-rate trials (run at the search's own seeds, before the seeds)."""
ALPHA, POWER = 0.05, 0.80
"""The verdict's level (two-sided, family-wise under Holm's correction) and the power of its detectable difference."""


@dataclass(frozen=True)
class ConfirmSettings:
    """``hydra.sweeper.confirm``, validated."""

    top: int
    seeds: int
    objective: str
    baseline_trials: int = 4
    """CE-only trials over the searched learning-rate range before the confirmation (0, or no learning rate in the
    search space: CE-only runs at the best point's)."""
    more_seeds: int = 3
    """When the budget ended the search, what it leaves once every planned confirmation trial has started buys more
    seeds of top1 and CE-only, a pair at a time while a pair fits (priced as their seeds ran), up to this many more
    (0: none). The reserve prices CE-only as a KD trial (its real cost is known only once it ran), so without them a
    sweep could end several CE-only trials' teacher work short of its budget."""
    lr_searched: bool = False
    also: tuple[str, ...] = ()
    """Second measures the confirmation's seeds are scored on too, each compared paired between top1 and CE-only
    (its own family: the verdict's decision stays on ``objective``): a student's eval metric (``kl``, or
    ``student_ce`` when it is not the objective; lower is better) or an lm-eval task's accuracy (``lm_eval/<task>``,
    the seeds' trials score it: ``downstream.tasks``; higher is better)."""

    @classmethod
    def of(cls, raw: dict[str, Any] | None, objectives: tuple[str, ...], trial_limit: float,
           searched: tuple[str, ...] = ()) -> "ConfirmSettings | None":
        if not raw or not raw.get("top"):  # top 0: no confirmation
            return None
        unknown = set(raw) - {"top", "seeds", "objective", "baseline_trials", "more_seeds", "also"}
        if unknown:
            raise ConfigError(f"hydra.sweeper.confirm has unknown keys {sorted(unknown)}; use top, seeds, objective, "
                              "baseline_trials, more_seeds, also")
        top, seeds, baseline = int(raw.get("top", 1)), int(raw.get("seeds", 3)), int(raw.get("baseline_trials", 4))
        more = int(raw.get("more_seeds", 3))
        if more < 0:
            raise ConfigError(f"hydra.sweeper.confirm.more_seeds={more} must be >= 0 (0: no more seeds from what the "
                              "budget leaves); pass hydra.sweeper.confirm.more_seeds=0")
        if top < 0 or seeds < 3:
            raise ConfigError(f"hydra.sweeper.confirm={dict(raw)}: top must be >= 1 (0: none) and seeds >= 3 (two "
                              "seeds give an interval 12.7 standard errors wide); pass hydra.sweeper.confirm.seeds=3")
        if baseline < 0:
            raise ConfigError(f"hydra.sweeper.confirm.baseline_trials={baseline} must be >= 0 (0: CE-only at the best "
                              "point's learning rate)")
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
        also = tuple([raw["also"]] if isinstance(raw.get("also"), str) else raw.get("also") or ())
        measures = [m for m in OBJECTIVES if m not in (objective, "teacher_ce")]  # the teacher's CE: not the student's
        for name in also:
            if not (name in measures or task_of(name)):
                raise ConfigError(f"hydra.sweeper.confirm.also={list(also)}: {name!r} is not a second measure; use "
                                  f"{' or '.join(measures)} or lm_eval/<task> (an lm-eval task, e.g. "
                                  "lm_eval/kdsweep_next_word)")
        return cls(top, seeds, objective, baseline, more, any(k in searched for k in LR_KEYS), also)

    @property
    def baseline_search(self) -> int:
        """How many CE-only learning-rate trials run (none when the search space has no learning rate)."""
        return self.baseline_trials if self.lr_searched else 0

    @property
    def seed_trials(self) -> int:
        """How many confirmation seeds' trials: every seed of the top points and of the CE-only baseline."""
        return (self.top + 1) * self.seeds

    @property
    def trials(self) -> int:
        """How many confirmation trials: the CE-only learning-rate trials and the seeds' trials."""
        return self.baseline_search + self.seed_trials


def _signed(value: float, direction: str) -> float:
    return value if direction == "minimize" else -value


def _range(distribution: Any) -> tuple[float, float]:
    """The learning-rate range of a searched distribution (an interval's bounds, or a choice's least and most)."""
    if hasattr(distribution, "choices"):
        return float(min(distribution.choices)), float(max(distribution.choices))
    return float(distribution.low), float(distribution.high)


def plan(trials: list[dict[str, Any]], confirm: ConfirmSettings, objectives: tuple[str, ...],
         directions: tuple[str, ...], distributions: dict[str, Any] | None = None, seed: int | None = 0
         ) -> dict[str, Any]:
    """The confirmation's points from the search's completed trials (the k best distinct points, best first, and the
    CE-only baseline), the CE-only learning-rate trials (log-uniform over the searched range, drawn from ``seed``)
    and the items (one per point and seed, in the order they are asked: seed by seed, top1 then CE-only first)."""
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
    out: dict[str, Any] = {"objective": confirm.objective, "index": index, "direction": direction, "points": points,
                           "items": [], "asked_top": confirm.top, "also": list(confirm.also)}
    if not points:
        return out
    best = points[0]["params"]
    searched_off = {k: 0.0 for k in (*KD_RATIO_KEYS, *LMBDA_KEYS) if k in best}
    baseline = {"label": BASELINE, "params": {**best, **searched_off, **CE_ONLY}, "search_trial": None}
    points.append(baseline)
    lr_key = next((k for k in LR_KEYS if k in best), None)
    search = []
    if lr_key is not None and confirm.baseline_search and distributions and lr_key in distributions:
        low, high = _range(distributions[lr_key])
        draw = random.Random(f"{seed}:{BASELINE_SEARCH}")
        values = sorted(math.exp(draw.uniform(math.log(low), math.log(high))) for _ in range(confirm.baseline_search))
        search = [{"label": f"{BASELINE_SEARCH}{i + 1}", "params": {**baseline["params"], lr_key: v}}
                  for i, v in enumerate(values)]
        out["baseline_search"] = {"key": lr_key, "range": [low, high], "points": search, "settled": None}
    # seed by seed, CE-only right after top1: a confirmation the budget cuts short still pairs the best point with
    # CE-only on the seeds that ran, instead of leaving the baseline, last in line, unrun
    paired = [points[0], baseline, *points[1:-1]]
    out["items"] = ([{"label": p["label"], "seed": None} for p in search]
                    + [{"label": p["label"], "seed": SEED_BASE + s} for s in range(confirm.seeds) for p in paired])
    return out


def point_params(confirmation: dict[str, Any], label: str) -> dict[str, Any]:
    """The params of the plan's point ``label`` (a confirmed point or a CE-only learning-rate trial)."""
    search = (confirmation.get("baseline_search") or {}).get("points", [])
    return next(p["params"] for p in [*confirmation["points"], *search] if p["label"] == label)


def baseline_pending(confirmation: dict[str, Any]) -> bool:
    """Whether the CE-only learning rate is still being searched (its seeds wait for it)."""
    search = confirmation.get("baseline_search")
    return search is not None and search["settled"] is None


def settle_baseline(confirmation: dict[str, Any], trials: list[dict[str, Any]]) -> bool:
    """Once every CE-only learning-rate trial has ended: the baseline takes the best one's learning rate (by the
    search's objective; the best point's own when none completed). Returns whether the plan changed."""
    if not baseline_pending(confirmation):
        return False
    search = confirmation["baseline_search"]
    labels = {p["label"] for p in search["points"]}
    ran = [t for t in trials if (t.get("confirm") or {}).get("label") in labels]
    if len(ran) < len(labels) or any(t["state"] not in FINAL for t in ran):
        return False
    completed = [t for t in ran if t["state"] == "COMPLETE"]
    baseline = next(p for p in confirmation["points"] if p["label"] == BASELINE)
    if completed:
        best = min(completed, key=lambda t: _signed(t["values"][confirmation["index"]], confirmation["direction"]))
        value, how = best["params"][search["key"]], f"the best of {len(labels)} CE-only trials"
    else:
        value, how = baseline["params"][search["key"]], "the best point's (no CE-only learning-rate trial completed)"
    baseline["params"] = {**baseline["params"], search["key"]: value}
    search["settled"] = {"value": value, "how": how, "completed": len(completed)}
    return True


def _asked(trials: list[dict[str, Any]]) -> set[tuple[str, int | None]]:
    """The (label, seed) of every confirmation item a trial was asked for."""
    return {(t["confirm"]["label"], t["confirm"]["seed"]) for t in trials if t.get("confirm")}


def next_item(confirmation: dict[str, Any], trials: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first item of the plan no trial runs yet (None: every one was asked, or what is left waits for the CE-only
    learning rate)."""
    asked = _asked(trials)
    waiting = baseline_pending(confirmation)
    return next((i for i in confirmation["items"] if (i["label"], i["seed"]) not in asked
                 and not (waiting and i["label"] == BASELINE)), None)


def more_seeds(confirmation: dict[str, Any]) -> list[dict[str, Any]]:
    """The next pair of items beyond the plan's seeds: top1's and CE-only's at the next seed."""
    seeds = [i["seed"] for i in confirmation["items"] if i["seed"] is not None]
    seed = max(seeds) + 1
    return [{"label": confirmation["points"][0]["label"], "seed": seed}, {"label": BASELINE, "seed": seed}]


def add_seeds(confirmation: dict[str, Any], pair: list[dict[str, Any]]) -> None:
    """Append :func:`more_seeds`'s pair to the plan (``more_seeds`` counts them: the verdict says so)."""
    confirmation["items"].extend(pair)
    confirmation["more_seeds"] = confirmation.get("more_seeds", 0) + 1


def _t(q: float, df: int) -> float:
    from scipy.stats import t as student_t

    return float(student_t.ppf(q, df))


def _interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% Student-t interval (nan with fewer than two values)."""
    mean = statistics.fmean(values) if values else math.nan
    if len(values) < 2:
        return mean, math.nan
    return mean, _t(1 - ALPHA / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def detectable(sd: float, n: int) -> float:
    """The smallest true mean difference a paired two-sided t-test at ``ALPHA`` finds with probability ``POWER``
    over ``n`` seeds of differences with standard deviation ``sd``: (t_{1−α/2} + t_{power})·sd/√n, n − 1 df."""
    return (_t(1 - ALPHA / 2, n - 1) + _t(POWER, n - 1)) * sd / math.sqrt(n)


def seeds_to_resolve(sd: float, n: int, difference: float, most: int = 1000) -> int | None:
    """How many seeds in all would make ``difference`` detectable (None: more than ``most``, or no difference)."""
    if difference == 0 or math.isnan(sd):
        return None
    return next((m for m in range(max(n, 2), most + 1) if detectable(sd, m) <= abs(difference)), None)


def _paired(a: dict[int, float], b: dict[int, float]) -> dict[str, Any]:
    """a − b over the seeds both completed: mean, unadjusted 95% half-width, seeds, sd, and the two-sided p."""
    from scipy.stats import t as student_t

    seeds = sorted(set(a) & set(b))
    diffs = [a[s] - b[s] for s in seeds]
    mean, half = _interval(diffs)
    if len(diffs) < 2:
        sd = p = math.nan
    else:
        sd = statistics.stdev(diffs)
        t = abs(mean) / (sd / math.sqrt(len(diffs))) if sd > 0 else math.inf if mean != 0 else 0.0
        p = float(2 * student_t.sf(t, len(diffs) - 1))  # no spread: p 0 for a difference, 1 for none
    return {"mean": mean, "ci95": half, "seeds": len(diffs), "sd": sd, "p": p}


def holm(comparisons: list[dict[str, Any]]) -> None:
    """Holm's step-down over ``comparisons`` (each with ``p`` and ``seeds``): each gets ``holm_t``, the t quantile
    its step tests at (t(1 − α/(2(m − i)), n − 1) for the i-th smallest p of m), and ``distinct``, whether it is
    rejected (every smaller p was too). Comparisons without a p (fewer than 2 seeds) are not counted."""
    tested = sorted((c for c in comparisons if not math.isnan(c["p"])), key=lambda c: c["p"])
    going = True
    for i, c in enumerate(tested):
        level = ALPHA / (len(tested) - i)
        c["holm_t"], c["holm_of"] = _t(1 - level / 2, c["seeds"] - 1), len(tested)
        going = going and c["p"] <= level
        c["distinct"] = going
    for c in comparisons:
        c.setdefault("distinct", False)


def _point_text(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def baseline_text(confirmation: dict[str, Any]) -> str:
    """What the verdict compared against: CE-only (no teacher in training), and where its learning rate came from."""
    search = confirmation.get("baseline_search")
    if search is None or search["settled"] is None:
        return "baseline: CE-only (kd_ratio=0, lmbda=0, no seq_kd) at the best point's learning rate"
    return (f"baseline: CE-only (kd_ratio=0, lmbda=0, no seq_kd) at {search['key']}={search['settled']['value']:.4g}, "
            f"{search['settled']['how']}")


def _judged(c: dict[str, Any], name: str, direction: str) -> str:
    """One comparison as the line says it: who is better, the unadjusted interval, Holm's decision and what the
    seeds could see."""
    if math.isnan(c["ci95"]):
        return f"{name} not confirmed on 2 or more shared seeds"
    gain = -_signed(c["mean"], direction)  # > 0: the first is better
    t = f"Holm over {c['holm_of']} comparison{'s' if c['holm_of'] != 1 else ''}: t={c['holm_t']:.3f}"
    if c["distinct"]:
        who = f"beats {name}" if gain > 0 else f"{name} beats it"
        return f"{who} by {abs(gain):.4f} ± {c['ci95']:.4f} ({c['seeds']} seeds; {t})"
    text = (f"not distinguishable from {name} ({gain:+.4f} ± {c['ci95']:.4f} unadjusted, {c['seeds']} seeds; {t}; "
            f"detectable: {detectable(c['sd'], c['seeds']):.4f}")
    more = seeds_to_resolve(c["sd"], c["seeds"], gain)
    if more is not None and more > c["seeds"]:
        text += f"; {more - c['seeds']} more seeds would resolve {abs(gain):.4f}"
    return text + ")"


def _shortfall(confirmation: dict[str, Any], trials: list[dict[str, Any]], tops: list[dict[str, Any]]) -> str:
    """What the verdict lacks of what was asked, and why: fewer points than ``top`` (the search completed fewer),
    trials the budget left unstarted (``cut``), points none of whose seeds completed."""
    asked_top, notes = confirmation.get("asked_top", len(tops)), []
    if len(tops) < asked_top:
        why = f" before {confirmation['search_ended_by']} ended it" if confirmation.get("search_ended_by") else ""
        notes.append(f"the search completed {len(tops)} distinct point(s) of the {asked_top} asked for "
                     f"confirmation{why}")
    started = _asked(trials)
    missing = [i for i in confirmation["items"] if (i["label"], i["seed"]) not in started]
    if missing:
        notes.append(f"{len(confirmation['items']) - len(missing)} of its {len(confirmation['items'])} trials ran: "
                     f"{confirmation.get('cut', 'the sweep ended')} before the rest")
    unconfirmed = [r["label"] for r in tops if not r["seeds"]]
    if unconfirmed:
        notes.append(f"no seed of {', '.join(unconfirmed)} completed")
    return "".join(f"; {n}" for n in notes)


def verdict(confirmation: dict[str, Any], trials: list[dict[str, Any]], objectives: tuple[str, ...]) -> dict[str, Any]:
    """Per point: mean ± 95% over its seeds and its paired differences to CE-only and to ``top1``; the verdict line on
    ``top1``, the search's best: against CE-only, and each other top point against it, under Holm's correction."""
    index = objectives.index(confirmation["objective"])
    direction = confirmation["direction"]
    by_label: dict[str, dict[int, float]] = {p["label"]: {} for p in confirmation["points"]}
    on_eval: dict[str, dict[int, float]] = {p["label"]: {} for p in confirmation["points"]}
    done = [t for t in trials if (t.get("confirm") or {}).get("label") in by_label and t["state"] == "COMPLETE"]
    split = "test" if all(t.get("test") for t in done) else "eval"  # eval: a sweep planned before the test split
    scored = "test" if split == "test" else "values"  # a trial's test-split objectives, or its eval split's
    for t in done:
        label, seed = t["confirm"]["label"], t["confirm"]["seed"]
        by_label[label][seed] = t[scored][index]
        on_eval[label][seed] = t["values"][index]
    rows = []
    for p in confirmation["points"]:
        mean, half = _interval(list(by_label[p["label"]].values()))
        rows.append({**p, "seeds": sorted(by_label[p["label"]]), "mean": mean, "ci95": half, "split": split,
                     "eval_mean": _interval(list(on_eval[p["label"]].values()))[0]})
    tops = [r for r in rows if r["label"] != BASELINE]
    short = _shortfall(confirmation, trials, tops)
    if not tops or not tops[0]["seeds"]:
        return {"points": rows, "best": None, "line": "the search's best was not confirmed: no verdict" + short}
    best = tops[0]
    for r in rows:  # every paired difference, for the table; the line decides on top1 against CE-only and each
        r["vs_ce_only"] = _paired(by_label[r["label"]], by_label.get(BASELINE, {}))  # other top point against top1
        r["vs_best"] = _paired(by_label[r["label"]], by_label[best["label"]])
    holm([best["vs_ce_only"], *(r["vs_best"] for r in tops[1:])])
    line = (f"{_point_text(best['params'])}: {best['mean']:.4f} ± {best['ci95']:.4f} on the {split} split over "
            f"{len(best['seeds'])} seeds; " + _judged(best["vs_ce_only"], "CE-only", direction))
    for r in tops[1:]:
        line += f"; {r['label']}: " + _judged(r["vs_best"], "top1", direction)
    second = {name: _second_measure(name, done, best["label"]) for name in confirmation.get("also", [])}
    for name, m in second.items():
        line += f"; on {name}, top1 {m['mean']:.4f} ± {m['ci95']:.4f}: " + _judged(m["vs_ce_only"], "CE-only",
                                                                                    m["direction"])
    more = confirmation.get("more_seeds", 0)
    if more:
        line += f"; {more} more seed{'s' if more > 1 else ''} of top1 and CE-only from what the budget left"
    return {"points": rows, "best": best["label"], "line": f"{line}; {baseline_text(confirmation)}{short}",
            **({"also": second} if second else {})}


def _second_measure(name: str, done: list[dict[str, Any]], best: str) -> dict[str, Any]:
    """A second measure (``confirm.also``) of top1 and CE-only over their seeds: top1's mean ± 95%, CE-only's, and
    their paired difference, tested on its own (a family of one: the verdict's decision stays on its objective)."""
    values: dict[str, dict[int, float]] = {best: {}, BASELINE: {}}
    for t in done:
        label, value = t["confirm"]["label"], (t.get("also") or {}).get(name, math.nan)
        if label in values and math.isfinite(value):
            values[label][t["confirm"]["seed"]] = value
    mean, half = _interval(list(values[best].values()))
    comparison = _paired(values[best], values[BASELINE])
    holm([comparison])
    return {"direction": "maximize" if task_of(name) else "minimize", "mean": mean, "ci95": half,
            "ce_only": _interval(list(values[BASELINE].values()))[0], "seeds": sorted(values[best]),
            "vs_ce_only": comparison}


__all__ = ["BASELINE", "BASELINE_SEARCH", "CE_ONLY", "ConfirmSettings", "SEED_BASE", "UNBIASED", "add_seeds",
           "baseline_pending", "detectable", "holm", "more_seeds", "next_item", "plan", "point_params",
           "seeds_to_resolve", "settle_baseline", "verdict"]
