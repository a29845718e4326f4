"""What a sweep cost, from its trials' run.json: device-seconds, trained tokens, teacher tokens computed and read,
and what pruning and the teacher-logit cache saved against running every trial to the end with a live teacher.

Each trial's ``cost`` (kdsweep.metrics.records) counts its attempts: wall seconds from its job's start, device-seconds
(wall × ranks), trained tokens, and the teacher positions a model computed (a live teacher's forwards and the tokens
it generated under ``rollout.seq_kd``, or the one cache build) or a cache supplied. The savings are estimates, and
named so:

- pruning: each pruned trial's missing steps at its own device-seconds per step (of its steps and evals);
- the cache: every position read from it at the build's measured device-seconds per teacher position, plus one
  teacher load (the build's measured load time × ranks) for every trial that did not load the teacher.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kdsweep.metrics.records import read_run
from kdsweep.sweep.manifest import Manifest
from kdsweep.sweep.workers import idle_device_seconds

FIELDS = ("trial_seconds", "device_seconds", "startup_seconds", "train_tokens", "teacher_tokens_computed",
          "teacher_tokens_read", "teacher_tokens_generated")


def _record(entry: dict[str, Any]) -> dict[str, Any]:
    return read_run(entry["run_dir"])


def _teachers(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A run's teachers' targets records: its one teacher's, or each of several's (``teachers=[...]``)."""
    targets = record.get("teacher_targets") or {}
    return targets.get("teachers") or [targets]


def _build_stats(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The cache build's measured cost: the trial that built it, or the cache's own meta.json (an earlier sweep)."""
    targets = [t for r in records for t in _teachers(r)]
    built = next((t["build"] for t in targets if t.get("build")), None)
    if built is None:
        cache = next((Path(t["dir"]) / "meta.json" for t in targets if t.get("dir")), None)
        built = json.loads(cache.read_text()).get("built") if cache is not None and cache.exists() else None
    return built


def sweep_cost(manifest: Manifest) -> dict[str, Any]:
    records = [(e, _record(e)) for e in manifest.trials.values()]
    records = [(e, r) for e, r in records if r.get("cost")]
    total = {k: sum(r["cost"].get(k, 0) for _, r in records) for k in FIELDS}
    # warm workers: the seconds they held their devices between trials count too (a trial's own start is in its cost)
    total["worker_idle_device_seconds"] = idle_device_seconds(manifest.path.parent)
    total["device_seconds"] += total["worker_idle_device_seconds"]
    pruning = 0.0
    for entry, r in records:
        steps, max_steps = r["cost"].get("steps", 0), r["config"]["train"]["max_steps"]
        if entry["state"] == "PRUNED" and steps:  # its own seconds per step (steps and evals), on all its ranks
            per_step = r["cost"]["loop_seconds"] * r["cost"]["device_seconds"] / r["cost"]["trial_seconds"] / steps
            pruning += (max_steps - r.get("steps", steps)) * per_step
    build = _build_stats([r for _, r in records])
    cache, readers = 0.0, sum(1 for _, r in records for t in _teachers(r) if t.get("source") == "cache"
                              and not t.get("built"))
    if build and build.get("teacher_tokens"):
        per_token = build["device_seconds"] / build["teacher_tokens"]
        cache = total["teacher_tokens_read"] * per_token + readers * build.get("teacher_load_s", 0.0) * build["ranks"]
    live = total["device_seconds"] + pruning + cache
    return {**total, "trials": len(records), "comm_per_step": comm_per_step([r for _, r in records]),
            "cache_builds": sum(1 for _, r in records for t in _teachers(r) if t.get("built")),
            "saved_by_pruning_device_seconds": pruning, "saved_by_cache_device_seconds": cache,
            "live_no_pruning_device_seconds": live, "ratio": total["device_seconds"] / live if live else None}


def comm_per_step(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's collectives per training step (run.json ``comm.per_step``), bytes by model and kind, averaged over
    the trials that trained on several ranks."""
    having = [r["comm"]["per_step"] for r in records
              if (r.get("comm") or {}).get("steps") and r.get("world_size", 1) > 1]
    out: dict[str, dict[str, float]] = {}
    for per_step in having:
        for owner, kinds in per_step.items():
            for kind, c in kinds.items():
                out.setdefault(owner, {}).setdefault(kind, 0.0)
                out[owner][kind] += c["bytes"] / len(having)
    return {"trials": len(having), "bytes": out}


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def comm_line(comm: dict[str, Any]) -> str | None:
    """``kdsweep status``: what a training step moves, per model (None when no trial ran on several ranks)."""
    if not comm.get("trials"):
        return None
    parts = []
    for owner in sorted(comm["bytes"], key=lambda o: (o == "other", o)):
        kinds = comm["bytes"][owner]
        detail = ", ".join(f"{k.replace('_', '-')} {_size(v)}" for k, v in sorted(kinds.items()) if v)
        parts.append(f"{owner} {_size(sum(kinds.values()))}" + (f" ({detail})" if detail else ""))
    teachers = [o for o in comm["bytes"] if o.startswith("teacher")]
    return (f"collectives per training step (rank 0, bytes on the wire; mean of {comm['trials']} trial(s)): "
            + "; ".join(parts) + ("" if teachers else "; teacher none (replicated, or a cache)"))


def cache_lines(manifest: Manifest) -> list[str]:
    """``kdsweep status``: each teacher-logit cache the sweep's trials read, what it keeps and what that weighs: bytes
    per position (its teacher's whole vocabulary per position, or a few fields), positions held, bytes on disk."""
    seen: dict[str, dict[str, Any]] = {}
    for entry in manifest.trials.values():
        for t in _teachers(_record(entry)):
            if t.get("source") == "cache" and t.get("dir"):
                seen.setdefault(t["dir"], t)
    lines = []
    for where, t in sorted(seen.items()):
        meta = Path(where) / "meta.json"
        positions = sum(s["positions"] for s in json.loads(meta.read_text())["splits"].values()) if meta.exists() else 0
        kind = "cross-tokenizer " if "cross_tokenizer" in t else ""
        k = f" k={t['k']}" if t["method"] != "full" else ""
        lines.append(f"teacher cache {Path(where).name}: {kind}{t['method']}{k}, {t['bytes_per_position']:,} B per "
                     f"position × {positions:,} positions = {_size(t['bytes_per_position'] * positions)}")
    return lines


def cost_lines(cost: dict[str, Any]) -> list[str]:
    """The sweep's cost for ``kdsweep status`` and the sweep's summary."""
    if not cost["trials"]:
        return ["cost: no trial has recorded its cost yet"]
    generated = f"{int(cost['teacher_tokens_generated'])} generated, " if cost["teacher_tokens_generated"] else ""
    lines = [
        f"cost: {cost['trials']} trials, {cost['device_seconds']:.1f} device-s ({cost['trial_seconds']:.1f} trial-s), "
        f"{int(cost['train_tokens'])} tokens trained; teacher: {int(cost['teacher_tokens_computed'])} tokens computed "
        f"({generated}{cost['cache_builds']} cache build{'s' if cost['cache_builds'] != 1 else ''}), "
        f"{int(cost['teacher_tokens_read'])} read from the cache",
        f"start-up: {cost['startup_seconds']:.1f} trial-s before the trials' first steps"
        + (f"; workers idle {cost['worker_idle_device_seconds']:.1f} device-s (counted above)"
           if cost.get("worker_idle_device_seconds") else ""),
    ]
    line = comm_line(cost.get("comm_per_step") or {})
    if line:
        lines.append(line)
    if cost["ratio"] is not None:
        lines.append(
            f"saved (estimates): pruning {cost['saved_by_pruning_device_seconds']:.1f} device-s, teacher cache "
            f"{cost['saved_by_cache_device_seconds']:.1f} device-s; every trial to the end with a live teacher: about "
            f"{cost['live_no_pruning_device_seconds']:.1f} device-s (this sweep: {cost['ratio']:.2f}x of it)"
        )
    return lines
