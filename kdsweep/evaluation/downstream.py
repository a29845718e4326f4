"""A run's downstream measure: lm-evaluation-harness tasks (``downstream.tasks``) scored on the trained student at
the end of a completed run, as ``kdsweep eval`` scores a model. Each task's headline metric is kept in run.json's
``downstream`` and, as ``lm_eval/<task>``, beside the held-out CE in ``eval_after`` (and ``test_after``), so that a
sweep may optimise it (``hydra.sweeper.objectives=[lm_eval/<task>]``) or confirm its answer on it too
(``hydra.sweeper.confirm.also``). The task's items are its own: the same measure on either split."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from kdsweep.config.schema import DownstreamConfig

PREFIX = "lm_eval/"


def measure(task: str) -> str:
    """The name a task's headline metric has beside the held-out CE (``lm_eval/<task>``)."""
    return PREFIX + task


def task_of(name: str) -> str | None:
    """The lm-eval task a measure names (None: not an lm-eval measure)."""
    return name[len(PREFIX):] if name.startswith(PREFIX) and len(name) > len(PREFIX) else None


def check(cfg: DownstreamConfig, where: str | None = None) -> None:
    """Before anything runs: lm-eval installed, and every task known to it (one line each, naming ``where`` the
    tasks were asked for, and the fix)."""
    if not cfg.tasks:
        return
    from kdsweep.evaluation.harness import require_lm_eval, task_manager

    where = where or f"downstream.tasks={list(cfg.tasks)}"
    require_lm_eval(who=where)
    task_manager(list(cfg.tasks), [Path(p) for p in cfg.include], flags=(where, "downstream.include=[DIR]"))


def score(exports: dict[str, str], cfg: DownstreamConfig, keep_merged: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """``({task: {metric, value, stderr, higher_is_better, items}}, exports)`` of the merged student in
    ``exports["merged"]``; that export is removed after scoring unless ``keep_merged`` (it was written only to be
    scored)."""
    from kdsweep.evaluation.harness import evaluate, task_manager

    merged = Path(exports["merged"])
    try:
        manager = task_manager(list(cfg.tasks), [Path(p) for p in cfg.include])
        scores = evaluate(merged, list(cfg.tasks), manager, cfg.batch_size, cfg.limit)
    finally:  # scored or not, a merged student written only to be scored does not stay on disk
        if not keep_merged:
            shutil.rmtree(merged, ignore_errors=True)
    return scores, exports if keep_merged else {k: v for k, v in exports.items() if k != "merged"}


def lower_is_better(record: dict[str, Any], name: str) -> str | None:
    """Why a sweep cannot rank on the measure ``name`` as run.json ``record`` scored it: its task's headline metric is
    lower-is-better (a perplexity; kdsweep ranks lm-eval measures higher-is-better), else None."""
    task = task_of(name)
    score = (record.get("downstream") or {}).get(task) if task else None
    if score is None or score.get("higher_is_better") is not False:
        return None
    return (f"{name}: the task's headline metric, {score['metric']}, is lower-is-better, and a sweep ranks lm-eval "
            "tasks by a higher-is-better one (acc); pick a task scored by accuracy")


def values(scores: dict[str, Any]) -> dict[str, float]:
    """``{lm_eval/<task>: headline value}``, as ``eval_after`` and ``test_after`` keep them."""
    return {measure(task): float(s["value"]) for task, s in scores.items()}


__all__ = ["PREFIX", "check", "lower_is_better", "measure", "score", "task_of", "values"]
