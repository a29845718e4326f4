"""``kdsweep status``'s table of a sweep's trials (and the sweeper's at its end): state, objective, job, time,
params and output directory, the best marked, the verdict last."""

from __future__ import annotations

import time
from typing import Any

from kdsweep.sweep.manifest import Manifest


def job_name(job: dict[str, Any] | None) -> str:
    """How the summary names a trial's job: its worker, SLURM job or process; one that ended while no controller
    watched it (a controller killed in the launch window: its record was found, its job no longer was) says so."""
    if not job:
        return "-"
    for key, name in (("worker", "worker"), ("slurm_job_id", "slurm"), ("pid", "pid")):
        if key in job:
            return f"{name} {job[key]}"
    return "ended unwatched"


def _searched(manifest: Manifest) -> list[tuple[int, list[float]]]:
    """The completed search trials (not the confirmation's: the verdict is theirs), by number, with their values
    signed so that lower is better."""
    signs = [1 if d == "minimize" else -1 for d in manifest.data["settings"]["directions"]]
    trials = sorted(manifest.trials.values(), key=lambda e: e["number"])
    return [(t["number"], [s * v for s, v in zip(signs, t["values"])]) for t in trials
            if t["state"] == "COMPLETE" and not t.get("confirm")]


def search_best(manifest: Manifest) -> int | None:
    """The search's best trial, by its one objective (the first of the best value); None before a search trial has
    completed, or in a study of several objectives (no single best: its Pareto front)."""
    done = _searched(manifest)
    if not done or len(manifest.data["settings"]["directions"]) > 1:
        return None
    return min(done, key=lambda d: d[1])[0]


def summary_lines(manifest: Manifest) -> list[str]:
    """A table of the sweep's trials (state, objective, job, duration, params, output dir), best marked."""
    trials = sorted(manifest.trials.values(), key=lambda e: e["number"])
    single = len(manifest.data["settings"]["directions"]) == 1
    done = _searched(manifest)
    # the best trial; with several objectives, every trial no other one beats on all of them (the Pareto front)
    front = {n for n, v in done if not any(w != v and all(a <= b for a, b in zip(w, v)) for _, w in done)}
    best = {search_best(manifest)} if single else front
    tag = "  <- best" if single else "  <- pareto"
    lines = [f"{'trial':>5}  {'state':<8} {'objective':>10}  {'job':<12} {'time':>6}  params  (output dir)"]
    for t in trials:
        objective = ",".join(f"{v:.4f}" for v in t["values"]) if t.get("values") else "-"
        seconds = (t.get("ended") or time.time()) - t["started"] if t.get("started") else None
        duration = "-" if seconds is None else f"{seconds:.0f}s" if seconds < 600 else f"{seconds / 60:.0f}m"
        mark = tag if t["number"] in best else ""
        params = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t["params"].items())
        if t.get("confirm"):
            seed = t["confirm"]["seed"]
            params += f" [confirm {t['confirm']['label']}{'' if seed is None else f' seed {seed}'}]"
        if t.get("pack"):  # a packed job's member (hydra.sweeper.pack): the trials it trained with
            params += f" [pack {'+'.join(map(str, t['pack']['members']))}]"
        lines.append(f"{t['number']:>5}  {t['state']:<8} {objective:>10}  {job_name(t.get('job')):<12} {duration:>6}  "
                     f"{params}  ({t['run_dir']}){mark}"
                     + (f"  ({t['reason']})" if t.get("reason") and t["state"] == "FAIL" else ""))
    verdict = manifest.data.get("verdict")
    return lines + ([f"verdict: {verdict['line']}"] if verdict else [])


__all__ = ["job_name", "search_best", "summary_lines"]
