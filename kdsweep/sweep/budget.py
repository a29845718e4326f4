"""A sweep's budget: device-hours (``hydra.sweeper.budget``) and wall-clock hours (``hydra.sweeper.wall_hours``).

Spent device-seconds are counted as the sweep's ``cost`` counts them (:mod:`kdsweep.sweep.cost`): each trial's
recorded device-seconds (wall from its job's start × its ranks, every attempt), the warm workers' idle time × their
ranks, and, for a trial still running, at least its time since it started × its ranks (its record is written at
checkpoints and at its end).

What a trial costs: a new search trial the finished trials' median device-seconds (a pruned trial's too, since the
search will prune again); a trial run to its end (**a full trial**: one still running may be promoted to the end, and
a confirmation's always is) what the finished trials would have cost at their end, a pruned one's start-up once and
its steps scaled to ``train.max_steps`` (their mean, for the confirmation's reserve; their largest, for what a running
trial may still spend). On warm workers only the warm trials count once one has finished (a worker's first trial
pays its start-up, which no later one does). Before any trial has finished: ``trial_hours``, else the running
trials' own pace projected to their last step (their device-seconds so far over the share of steps done); a trial
that has not logged a step yet tells nothing, and no other trial starts until one has.

A confirmation seed's trial trains with the live teacher (``confirm.UNBIASED``). After a search that read the teacher
cache it is priced apart (:meth:`Budget.seed_trial`): by the confirmation seeds that have finished, else by their own
pace while they run, else by the cached trials plus the teacher's work the cache's build measured (in the sweep or
before it: its load, and its device-seconds per token for every token a cached trial read), else by ``trial_hours``;
with none of these, one seed trial runs alone as the probe until its pace tells.

The controller asks for a search trial while what is spent, plus what the running trials may still spend, plus the
confirmation's reserve (:meth:`Budget.allows`) leaves part of the budget; a confirmation trial while what is spent
and what the running confirmation trials will still spend (a mean trial each, as reserved) leaves part of it
(:meth:`Budget.allows_reserved`). So whatever the mix
of pruned, promoted and failed trials, the sweep spends at most its budget and one full trial (a full pack, where
``hydra.sweeper.pack`` packs them: each member is asked as a trial, priced at a member's share), and a search stopped
by it leaves only the confirmation's reserve. The wall-clock limit starts no trial that would end after it (a trial
takes the finished trials' median wall seconds). A resumed sweep continues both: the records are on disk, and the
controllers' wall time is kept in the manifest (``wall_s``).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from kdsweep.metrics.records import read_json, read_run
from kdsweep.sweep.manifest import FINAL, Manifest
from kdsweep.sweep.workers import idle_device_seconds


def _record(entry: dict[str, Any]) -> dict[str, Any]:
    """A trial's run.json (empty before its first record; read-only)."""
    return read_run(entry["run_dir"])


def _cost(entry: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """A trial's recorded cost (empty before its first record) and its ranks (1 until its run.json says)."""
    record = _record(entry)
    return record.get("cost") or {}, int(record.get("world_size") or 1)


def _worker(record: dict[str, Any]) -> dict[str, Any]:
    return (record.get("environment") or {}).get("worker") or {}


def _warm_filter(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records that tell what the next trials cost: on warm workers the next trials start warm, so once a warm
    trial has finished only the warm ones count."""
    if any(_worker(r).get("start") == "warm" for r in records):
        return [r for r in records if _worker(r).get("start") == "warm"]
    return records


def _next_costs(entries: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """What these finished trials tell of the next one's cost: their device-seconds and wall seconds (the warm ones'
    once one has finished, :func:`_warm_filter`); a first (cold) trial's less its worker's own start-up before it
    took the trial (``boot_seconds``)."""
    out = []
    for record in _warm_filter([r for r in map(_record, entries) if (r.get("cost") or {}).get("device_seconds")]):
        cost, ranks, boot = record["cost"], int(record.get("world_size") or 1), _worker(record).get("boot_seconds", 0.0)
        out.append((cost["device_seconds"] - boot * ranks, cost.get("trial_seconds", 0.0) - boot))
    return out


def full_cost(record: dict[str, Any]) -> float | None:
    """A finished trial's device-seconds had it run to its last step (its worker's own boot left out): a completed
    one's as recorded; a pruned one's start-up once and its steps' cost scaled to ``train.max_steps``; None when its
    record does not tell (failed, or no steps)."""
    cost, ranks = record.get("cost") or {}, int(record.get("world_size") or 1)
    boot = float(_worker(record).get("boot_seconds", 0.0)) * ranks
    device = float(cost.get("device_seconds") or 0.0) - boot
    if device <= 0 or record.get("status") not in ("completed", "pruned"):
        return None
    if record["status"] == "completed":
        return device
    steps = int(record.get("steps") or 0)
    total = int(((record.get("config") or {}).get("train") or {}).get("max_steps") or 0)
    if steps <= 0 or total <= 0:
        return None
    startup = min(float(cost.get("startup_seconds") or 0.0) * ranks, device)
    return startup + (device - startup) * max(total, steps) / steps


def _progress(entry: dict[str, Any]) -> tuple[int, int] | None:
    """A running trial's last logged training step and its ``train.max_steps`` (None before its first step)."""
    total = int(((_record(entry).get("config") or {}).get("train") or {}).get("max_steps") or 0)
    path = Path(entry["run_dir"]) / "metrics.jsonl"
    if total <= 0 or not path.exists():
        return None
    with open(path, "rb") as f:
        f.seek(max(f.seek(0, 2) - 8192, 0))
        lines = f.read().decode(errors="replace").splitlines()
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("kind") == "train" and row.get("step"):
            return int(row["step"]), total
    return None


def is_seed(entry: dict[str, Any]) -> bool:
    """Whether a trial is a confirmation seed's (the live teacher, run to its end)."""
    return (entry.get("confirm") or {}).get("seed") is not None


def _built(cache_dir: str | None) -> dict[str, Any]:
    """What a teacher cache's build measured (its ``meta.json``'s ``built``; empty when it cannot be read)."""
    if not cache_dir:
        return {}
    try:
        return read_json(Path(cache_dir) / "meta.json").get("built") or {}
    except (OSError, ValueError):
        return {}


def teacher_work(records: list[dict[str, Any]]) -> tuple[float, float] | None:
    """What the live teacher adds to a cached trial, from its cache's build (made by a trial, or before the sweep:
    the cache's ``meta.json``): the teacher's load (seconds) and its device-seconds per token (the build's less the
    load, over the teacher tokens it computed); None when no record names a build."""
    for r in records:
        targets = r.get("teacher_targets") or {}
        b = targets.get("build") or _built(targets.get("dir"))
        if b.get("teacher_tokens"):
            load = float(b.get("teacher_load_s", 0.0))
            return load, max(b["device_seconds"] - load * b["ranks"], 0.0) / b["teacher_tokens"]
    return None


def as_live(record: dict[str, Any], load: float, per_token: float) -> float | None:
    """A completed cached trial's device-seconds had it run the live teacher: its own, and per rank the teacher's load
    and its work on every token the trial read from the cache."""
    cost = full_cost(record)
    read = float((record.get("cost") or {}).get("teacher_tokens_read") or 0.0)
    return None if cost is None else cost + int(record.get("world_size") or 1) * (load + per_token * read)


def _cold_only(entries: list[dict[str, Any]]) -> bool:
    """Warm workers whose finished trials were all their first (cold): no trial has shown what a warm one costs."""
    starts = [_worker(r).get("start") for r in map(_record, entries)]
    return bool(starts) and all(s == "cold" for s in starts)


class Budget:
    """What a sweep may spend and has spent; ``device_s`` / ``wall_s`` None: no limit of that kind."""

    def __init__(self, manifest: Manifest, device_hours: float | None, wall_hours: float | None,
                 trial_hours: float | None = None, cached: bool = False, pack: int = 1) -> None:
        self.manifest, self.pack = manifest, pack  # trials per job (hydra.sweeper.pack): a probe is a pack
        self.apart = cached  # the search reads the teacher cache: a confirmation seed (live) is priced apart
        self.estimate = None if trial_hours is None else trial_hours * 3600.0  # a trial's device-s, until one ends
        self.device_s = None if device_hours is None else device_hours * 3600.0
        self.wall_s = None if wall_hours is None else wall_hours * 3600.0
        self._wall_before = float(manifest.data.get("wall_s", 0.0))  # the earlier controllers' (a resume)
        self._session_start = time.time()

    @property
    def limited(self) -> bool:
        return self.device_s is not None or self.wall_s is not None

    # -- what was spent ----------------------------------------------------------------------------------------
    def wall_spent(self) -> float:
        """The seconds every controller of this sweep has run, this one included."""
        return self._wall_before + time.time() - self._session_start

    def keep_wall(self) -> None:
        """Save the wall time spent in the manifest (a resumed sweep continues the same wall-clock limit)."""
        self.manifest.data["wall_s"] = self.wall_spent()
        self.manifest.save()

    def trial_spent(self, entry: dict[str, Any], now: float) -> float:
        """A trial's device-seconds: as recorded; for one still running, at least its time since it started (a SLURM
        job's wait in the queue included, until its record says); for one that ended without a record (it failed
        before writing one), its time from start to end; a packed job's member, its share of these (the job's
        seconds over its members)."""
        cost, ranks = _cost(entry)
        recorded = float(cost.get("device_seconds", 0.0))
        if not entry.get("started"):
            return recorded
        share = ranks / len(entry["pack"]["members"]) if entry.get("pack") else ranks  # a member: its share of the job
        if entry.get("state") not in FINAL:
            return max(recorded, (now - entry["started"]) * share)
        return recorded or max(entry.get("ended", now) - entry["started"], 0.0) * share

    def device_spent(self, now: float | None = None) -> float:
        """Device-seconds spent by ``now``: every trial's and the workers' idle time."""
        now = time.time() if now is None else now
        return (sum(self.trial_spent(e, now) for e in self.manifest.trials.values())
                + idle_device_seconds(self.manifest.path.parent))

    def per_trial(self, states: tuple[str, ...] = FINAL) -> tuple[float | None, float | None]:
        """What the next trial costs, from the finished ones (in ``states``, as :func:`_next_costs` reads them): median
        device-seconds and median wall seconds (None when none has finished with a record)."""
        costs = _next_costs([e for e in self.manifest.trials.values() if e.get("state") in states])
        if not costs:
            return None, None
        return statistics.median(d for d, _ in costs), statistics.median(w for _, w in costs)

    def _searched(self) -> list[dict[str, Any]]:
        """The trials priced alike: every trial, or (priced apart) all but the confirmation seeds'."""
        return [e for e in self.manifest.trials.values() if not (self.apart and is_seed(e))]

    def _full_costs(self, entries: list[dict[str, Any]] | None = None) -> list[float]:
        entries = self._searched() if entries is None else entries
        finished = [_record(e) for e in entries if e.get("state") in ("COMPLETE", "PRUNED")]
        return [c for c in map(full_cost, _warm_filter(finished)) if c is not None]

    def _idle_share(self) -> float:
        finished = sum(e.get("state") in FINAL for e in self.manifest.trials.values())
        return idle_device_seconds(self.manifest.path.parent) / finished if finished else 0.0

    def _trial_costs(self) -> tuple[float | None, float | None]:
        """(the most, the mean) a trial run to its end costs: the finished trials' device-seconds at their end
        (:func:`full_cost`) and their share of the workers' idle time; before any has finished, ``trial_hours`` or
        the running trials' projection for both. One pass over the records and the workers' idle time."""
        costs = self._full_costs()
        if not costs:
            guess = self.estimate or self._projected()
            return guess, guess
        idle = self._idle_share()
        return max(costs) + idle, statistics.fmean(costs) + idle

    def reserved_trial(self) -> float | None:
        """What each reserved trial (a confirmation's: run to its end) is expected to cost: the mean of
        :meth:`_trial_costs`."""
        return self._trial_costs()[1]

    def full_trial(self) -> float | None:
        """The most a trial run to its end costs (the budget's tolerance: a sweep ends within one of these of its
        budget): the largest of :meth:`_trial_costs`."""
        return self._trial_costs()[0]

    def seed_trial(self) -> float | None:
        """What a confirmation seed's trial costs (:meth:`reserved_trial` unless priced apart): the finished seeds'
        mean full cost, else the running seeds' projected pace, else the completed cached trials' mean plus the live
        teacher's load and work on the tokens they read (:func:`teacher_work`), else ``trial_hours``; None: unknown
        (one seed runs alone as the probe)."""
        if not self.apart:
            return self.reserved_trial()
        seeds = [e for e in self.manifest.trials.values() if is_seed(e)]
        measured = self._full_costs(seeds)
        if measured:
            return statistics.fmean(measured) + self._idle_share()
        running = self._projected(seeds)
        if running is not None:
            return running
        work = teacher_work([_record(e) for e in self.manifest.trials.values()])
        cached = [_record(e) for e in self._searched() if e.get("state") == "COMPLETE"]
        live = [c for c in (as_live(r, *work) for r in cached) if c is not None] if work else []
        if live:
            return statistics.fmean(live) + self._idle_share()
        return self.estimate

    def _projected(self, entries: list[dict[str, Any]] | None = None) -> float | None:
        """The running trials' own pace projected to their last step: their device-seconds so far over the share
        of their steps done (start-up included, so an upper bound); the largest, or None before any logged a step."""
        now, seen = time.time(), []
        for entry in self._searched() if entries is None else entries:
            done = _progress(entry) if entry.get("state") == "RUNNING" and entry.get("started") else None
            if done is not None:
                seen.append(self.trial_spent(entry, now) * done[1] / done[0])
        return max(seen) if seen else None

    # -- what may start ----------------------------------------------------------------------------------------
    def _spent_and_committed(self, each: float) -> float:
        """What is spent, and what the running trials will still spend, each up to ``each`` device-seconds in all;
        both at one instant, so a running trial counts ``each`` in all."""
        now = time.time()
        running = [e for e in self.manifest.trials.values() if e.get("state") not in FINAL]
        return self.device_spent(now) + sum(max(each - self.trial_spent(e, now), 0.0) for e in running)

    def allows(self, reserve: int = 0, at_once: int = 1, seeds: int = 0) -> bool:
        """Whether another search trial may start: spent + what the running trials may still spend + ``reserve``
        trials run to their end (the confirmation's share, ``seeds`` of them confirmation seeds', priced as
        :meth:`seed_trial` says) leaves part of the device budget, and a trial started now, and the reserved ones
        after it (``at_once`` at a time), would end before the wall-clock limit."""
        if not self.limited:
            return True
        _, wall = self.per_trial()
        _, full_wall = self.per_trial(("COMPLETE",))
        rounds = -(-reserve // max(at_once, 1))
        if self.wall_s is not None and self.wall_spent() + (wall or 0.0) + rounds * (full_wall or 0.0) > self.wall_s:
            return False
        if self.device_s is None:
            return True
        running = [e for e in self.manifest.trials.values() if e.get("state") not in FINAL]
        full, mean = self._trial_costs()
        if full is None:  # nothing is known of a trial's cost: one runs (one pack) until its pace tells
            return self._probe(running) and self.device_spent() < self.device_s
        seed = (self.seed_trial() or mean) if seeds else mean  # unknown: priced as a search trial until the probe
        if self._spent_and_committed(full) + (reserve - seeds) * mean + seeds * seed < self.device_s:
            return True  # (a running trial may be promoted: each counts a full trial)
        # the estimate is only cold trials' (a worker's first pays what no later one does): one more trial, warm,
        # tells the next ones' cost; it may run past the budget by its own cost, as the last trial may
        finished = [e for e in self.manifest.trials.values() if e.get("state") in FINAL]
        return self._probe(running) and _cold_only(finished) and self.device_spent() < self.device_s

    def _probe(self, running: list[dict[str, Any]]) -> bool:
        """Whether one more trial joins the one job that may run alone (a probe: its pace tells the next ones'
        cost): nothing runs, or, where trials are packed, only the pack being asked, short of its size."""
        return all(e.get("state") == "ASKED" for e in running) and len(running) < self.pack

    def allows_reserved(self, seed: bool = False) -> bool:
        """Whether a confirmation trial (``seed``: a confirmation seed's) may start: what is spent and what the running
        ones will still spend leave part of the device budget (the last one started may pass it by its own cost: one
        full trial). Running confirmation trials all run to their end, so each counts a trial's mean cost, the price
        the search reserved them at (the largest would cut the last of them whenever the search left exactly their
        reserve); a seed's as :meth:`seed_trial` prices it. A seed whose price nobody knows yet runs alone (the
        probe)."""
        if self.device_s is None:
            return True
        now = time.time()
        if seed and self.seed_trial() is None:
            running = [e for e in self.manifest.trials.values() if e.get("state") not in FINAL]
            return self._probe([e for e in running if is_seed(e)]) and self.device_spent(now) < self.device_s
        return self.device_spent(now) + self._reserved_committed(now) < self.device_s

    def _reserved_committed(self, now: float) -> float:
        """What the running trials will still spend, each priced as reserved: a confirmation seed's as
        :meth:`seed_trial` says, any other's at :meth:`reserved_trial`."""
        seed, mean = self.seed_trial() or 0.0, self.reserved_trial() or 0.0
        running = [e for e in self.manifest.trials.values() if e.get("state") not in FINAL]
        return sum(max((seed if is_seed(e) else mean) - self.trial_spent(e, now), 0.0) for e in running)

    def allows_more(self, labels: list[str]) -> bool:
        """Whether one more seed of each of these confirmed points fits: what is spent, what the running trials will
        still spend (as :meth:`allows_reserved` counts them) and each new seed at its point's own seeds' mean cost
        stay within the device budget (none may pass it: these are extra). False while a point has no finished seed."""
        if self.device_s is None:
            return False
        prices = []
        for label in labels:
            ran = [e for e in self.manifest.trials.values() if is_seed(e) and e["confirm"]["label"] == label]
            costs = self._full_costs(ran)
            if not costs:
                return False
            prices.append(statistics.fmean(costs) + self._idle_share())
        now = time.time()
        return self.device_spent(now) + self._reserved_committed(now) + sum(prices) <= self.device_s

    def record(self) -> dict[str, Any]:
        """``sweep.json``'s ``budget``: the limits, what was spent, what is left."""
        device, wall = self.per_trial()
        spent = self.device_spent()
        return {"device_hours": None if self.device_s is None else self.device_s / 3600.0,
                "wall_hours": None if self.wall_s is None else self.wall_s / 3600.0,
                "device_seconds_spent": spent, "wall_seconds_spent": self.wall_spent(),
                "device_seconds_left": None if self.device_s is None else self.device_s - spent,
                "trial_device_seconds": device, "trial_wall_seconds": wall,
                "full_trial_device_seconds": self.full_trial()}


def budget_lines(manifest: Manifest) -> list[str]:
    """``kdsweep status``: the budget, spent and left (nothing for a sweep without one)."""
    settings = manifest.data["settings"]
    budget = Budget(manifest, settings.get("budget"), settings.get("wall_hours"))
    budget._session_start = time.time()  # a status reads what the controllers kept, it adds no wall time
    if not budget.limited:
        return []
    spent = budget.device_spent()
    parts = []
    if budget.device_s is not None:
        left = budget.device_s - spent
        parts.append(f"{spent / 3600:.4g} of {budget.device_s / 3600:.4g} device-h spent "
                     f"({spent:.0f} device-s; "
                     f"{'left ' + format(left, '.0f') if left >= 0 else 'over by ' + format(-left, '.0f')} device-s)")
    if budget.wall_s is not None:
        parts.append(f"{budget.wall_spent() / 3600:.3g} of {budget.wall_s / 3600:.3g} wall-h")
    device, _ = budget.per_trial()
    trial = f"; a trial costs about {device:.0f} device-s" if device else ""
    return [f"budget: {'; '.join(parts)}{trial}"]


__all__ = ["Budget", "budget_lines"]
