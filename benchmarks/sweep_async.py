"""kdsweep's async search with pruning against a batch-synchronous search without pruning, same trials budget.

Same search space (conf/hparams_search/kd_optuna.yaml), budget (--n-trials, --concurrency) and sampler seed:

- async: the real `python -m kdsweep -m hparams_search=kd_optuna hydra.sweeper.workers=0` (one job per trial;
  refills a slot as soon as a trial ends, its pruner: percentile 75 as shipped), timed from its launch; trials
  read back from its sweep.json.
- batch: what hydra-optuna-sweeper does with a parallel launcher: ask `concurrency` trials from a TPE study with
  the same seed and a NopPruner, run them as concurrent `python -m kdsweep hparams_search=kd_optuna <params>`
  processes (the same fixed overrides the sweep gives its trials; OMP_NUM_THREADS = cores // concurrency like
  kdsweep's local backend), wait for the whole batch, tell, repeat.

Per arm: wall time, trial-seconds (sum of each trial's end - start), device-seconds (trial-seconds × ranks), best
objective (held-out student CE), the time and the device-seconds (of every trial, up to that moment) until the arm
first completes a trial at or below the batch arm's best, and pruned trials. With --cache the async arm reads a
teacher-logit cache (``teacher.logits=cache``, method sample, built by its first trial into a fresh directory:
the build is included) while the batch arm keeps the live teacher, as a hand-glued sweep does. With --workers N a
third arm runs the same sweep command on N warm trial workers (``hydra.sweeper.workers=N``, same cache settings):
its device-seconds are the seconds its workers held their ranks, from each worker's launch to its leaving (idle
time included). Every arm reports its trials' start-up seconds (run.json ``cost.startup_seconds``: from the
trial's process start, or from a warm worker taking the trial, to its first step).
The samplers see different histories (pruned trials, the order results arrive in), so the arms' trials may
differ once TPE leaves its random start-up trials (10 by default); each async row says whether its params
equal the batch trial with the same number. The arms run one after the other, never side by side.

    python benchmarks/sweep_async.py [--n-trials 8] [--concurrency 2] [--seed 0] [--extra train.max_steps=10 ...]
                                     [--cache] [--workers N] [--out benchmarks/results/sweep_async.json] [--keep DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
SEARCH = "kd_optuna"


def sweeper_yaml() -> dict[str, Any]:
    """hydra.sweeper of the shipped search, as written."""
    return yaml.safe_load((REPO / "conf" / "hparams_search" / f"{SEARCH}.yaml").read_text())["hydra"]["sweeper"]


def git_sha() -> str | None:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def trial_env(concurrency: int) -> dict[str, str]:
    """The environment kdsweep's LocalProcesses gives its trials (threads capped at cores // concurrency)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // max(1, concurrency))))
    return env


def device_seconds(rows: list[dict[str, Any]], until: float, ranks: int) -> float:
    """Seconds every trial held its ranks between the arm's start and ``until``."""
    return ranks * sum(max(0.0, min(r["ended"] if r["ended"] is not None else until, until) - r["started"])
                       for r in rows)


def summarize(rows: list[dict[str, Any]], wall_s: float, target: float | None, ranks: int = 1,
              tolerance: float = 0.0) -> dict[str, Any]:
    """Arm metrics from its trial rows (times relative to the arm's start)."""
    done = [r for r in rows if r["state"] == "COMPLETE"]
    best = min(done, key=lambda r: (r["objective"], r["ended"])) if done else None
    reached = [r["ended"] for r in done if target is not None and r["objective"] <= target]
    near = [r["ended"] for r in done if target is not None and r["objective"] <= target * (1 + tolerance)]
    return {
        "device_s_to_near_batch_best": round(device_seconds(rows, min(near), ranks), 2) if near else None,
        "wall_s": round(wall_s, 2),
        "trial_seconds": round(sum(r["ended"] - r["started"] for r in rows if r["ended"] is not None), 2),
        "device_seconds": round(device_seconds(rows, wall_s, ranks), 2),
        "device_s_to_batch_best": round(device_seconds(rows, min(reached), ranks), 2) if reached else None,
        "best_objective": best["objective"] if best else None,
        "best_trial": best["number"] if best else None,
        "s_to_own_best": round(min(r["ended"] for r in done if r["objective"] <= best["objective"]), 2) if best else None,
        "s_to_batch_best": round(min(reached), 2) if reached else None,
        "first_trial_started_s": round(min(r["started"] for r in rows), 2) if rows else None,
        "trials": len(rows),
        "complete": len(done),
        "pruned": sum(r["state"] == "PRUNED" for r in rows),
        "failed": sum(r["state"] == "FAIL" for r in rows),
    }


def startup(run_dir: Path) -> dict[str, Any]:
    """The trial's start-up seconds as its run.json counts them (None: it recorded no cost), and whether a warm
    worker ran it (start: warm), or a fresh process (cold)."""
    path = run_dir / "run.json"
    record = json.loads(path.read_text()) if path.exists() else {}
    cost, worker = record.get("cost") or {}, (record.get("environment") or {}).get("worker") or {}
    seconds = cost.get("startup_seconds")
    return {"startup_s": None if seconds is None else round(seconds, 3), "start": worker.get("start", "cold")}


def median(values: list[float]) -> float | None:
    values = sorted(values)
    if not values:
        return None
    mid = len(values) // 2
    return round(values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2, 3)


def pool_spans(sweep_dir: Path, t0: float) -> list[dict[str, Any]]:
    """Each warm worker's hold on its ranks: from its launch to its leaving, relative to the arm's start."""
    spans = []
    for d in sorted((sweep_dir / "workers").iterdir()):
        launch, state = (json.loads((d / f).read_text()) for f in ("launch.json", "worker.json"))
        spans.append({"name": d.name, "started": round(launch["launched"] - t0, 2), "ended": round(state["updated"] - t0, 2),
                      "ranks": state["ranks"], "trials_run": state["trials_run"], "idle_s": round(state["idle_s"], 2)})
    return spans


def pool_device_seconds(spans: list[dict[str, Any]], until: float) -> float:
    return sum(w["ranks"] * max(0.0, min(w["ended"], until) - w["started"]) for w in spans)


def run_async(work: Path, n: int, c: int, seed: int, extra: list[str],
              arm: str = "async") -> tuple[list[dict[str, Any]], float, list[str], float]:
    """The real sweep command; its trials from sweep.json, times relative to the launch (also returned)."""
    sweep_dir = work / arm
    cmd = [sys.executable, "-m", "kdsweep", "-m", f"hparams_search={SEARCH}", f"hydra.sweep.dir={sweep_dir}",
           f"hydra.sweeper.n_trials={n}", f"hydra.sweeper.max_concurrent={c}", f"hydra.sweeper.seed={seed}", *extra]
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(work / f"{arm}.log", "wb") as out:
        proc = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    if proc.returncode != 0:
        tail = (work / f"{arm}.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"the async sweep failed ({proc.returncode}):\n{tail}")
    manifest = json.loads((sweep_dir / "sweep.json").read_text())
    rows = []
    for number, t in sorted(manifest["trials"].items(), key=lambda kv: int(kv[0])):
        rows.append({
            "number": int(number), "params": t["params"], "state": t["state"],
            "objective": t["values"][0] if t.get("values") else None,
            "started": round(t["started"] - t0, 2), "ended": round(t["ended"] - t0, 2) if t.get("ended") else None,
            "attempts": t.get("attempts"), "reason": t.get("reason") or None,
            **startup(Path(t["run_dir"])),
        })
    return rows, wall, manifest["space"], t0


def read_objective(run_dir: Path, code: int) -> tuple[str, float | None, str | None]:
    record_path = run_dir / "run.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    value = record.get("objective")
    if value is None:
        value = (record.get("eval_after") or {}).get("student_ce")
    if code == 0 and record.get("status") == "completed" and value is not None and math.isfinite(value):
        return "COMPLETE", float(value), None
    return "FAIL", None, record.get("error") or f"exit {code}, status {record.get('status')}"


def run_batch(work: Path, n: int, c: int, seed: int, extra: list[str]) -> tuple[list[dict[str, Any]], float, list[dict]]:
    """Batch-synchronous ask/tell with no pruning, in this process; trials as concurrent local processes."""
    import optuna

    from kdsweep.sweep.space import parse_space
    from kdsweep.sweep.study import SweepSettings, make_pruner, make_sampler

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    raw = sweeper_yaml()
    settings = SweepSettings.from_plain({**raw, "n_trials": n, "max_concurrent": c, "seed": seed, "pruner": "none"})
    space = parse_space(dict(settings.params))
    distributions = {p.key: p.distribution() for p in space}
    study = optuna.create_study(sampler=make_sampler(settings, space), pruner=make_pruner(settings),
                                directions=list(settings.directions))
    env = trial_env(c)
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    while len(rows) < n:
        batch = [study.ask(distributions) for _ in range(min(c, n - len(rows)))]
        running = {}
        for trial in batch:
            run_dir = work / "batch" / str(trial.number)
            run_dir.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "kdsweep", f"hparams_search={SEARCH}", *extra,
                   *(f"{k}={v}" for k, v in trial.params.items()), f"hydra.run.dir={run_dir}"]
            with open(run_dir / "job.log", "wb") as out:
                proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
            running[trial.number] = (trial, proc, run_dir, time.time())
        ended: dict[int, float] = {}
        while len(ended) < len(running):  # the whole batch must end before the sampler sees any result
            for number, (_, proc, _, _) in running.items():
                if number not in ended and proc.poll() is not None:
                    ended[number] = time.time()
            time.sleep(0.1)
        for number, (trial, proc, run_dir, started) in running.items():
            state, value, reason = read_objective(run_dir, proc.returncode)
            if state == "COMPLETE":
                study.tell(trial, value)
            else:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            rows.append({"number": number, "params": trial.params, "state": state, "objective": value,
                         "started": round(started - t0, 2), "ended": round(ended[number] - t0, 2),
                         "attempts": 1, "reason": reason, **startup(run_dir)})
    return rows, time.time() - t0, json.loads(json.dumps([p.describe() for p in space]))  # as in sweep.json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-trials", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--extra", action="append", default=[], metavar="OVERRIDE",
                        help="a Hydra override for every trial of both arms (repeat it), e.g. train.max_steps=10")
    parser.add_argument("--cache", action="store_true",
                        help="the async arm reads a teacher-logit cache its first trial builds (the batch arm: live)")
    parser.add_argument("--cache-method", default="sample", choices=("full", "sample", "topk"))
    parser.add_argument("--workers", type=int, default=0,
                        help="also run the sweep on this many warm trial workers (hydra.sweeper.workers)")
    parser.add_argument("--tolerance", type=float, default=0.001,
                        help="also report when an arm first gets within this relative distance of the batch best")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "sweep_async.json"))
    parser.add_argument("--keep", default=None, help="keep the arms' run directories here (default: a temp dir)")
    args = parser.parse_args()
    n, c, seed = args.n_trials, args.concurrency, args.seed

    work = Path(args.keep or tempfile.mkdtemp(prefix="sweep_async-")).resolve()
    try:
        print(f"async arm: kdsweep -m hparams_search={SEARCH}, {n} trials, {c} at a time, seed {seed}", flush=True)
        cache = ["teacher.logits=cache", f"teacher.cache.method={args.cache_method}",
                 f"teacher.cache.dir={work / 'teacher_cache'}"]
        async_extra = [*args.extra, *(cache if args.cache else [])]
        async_rows, async_wall, async_space, _ = run_async(work, n, c, seed, [*async_extra, "hydra.sweeper.workers=0"])
        print(f"batch arm: batches of {c}, no pruning", flush=True)
        batch_rows, batch_wall, batch_space = run_batch(work, n, c, seed, args.extra)
        pool = None
        if args.workers:
            print(f"warm workers arm: the same sweep on {args.workers} workers", flush=True)
            if args.cache:  # its own cache, built by its first trial, as the per-trial arm's was
                async_extra = [*args.extra, *cache[:2], f"teacher.cache.dir={work / 'teacher_cache_workers'}"]
            pool_rows, pool_wall, pool_space, pool_t0 = run_async(
                work, n, c, seed, [*async_extra, f"hydra.sweeper.workers={args.workers}"], arm="workers")
            pool = (pool_rows, pool_wall, pool_space, pool_spans(work / "workers", pool_t0))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if async_space != batch_space or (pool is not None and pool[2] != batch_space):
        raise SystemExit(f"the arms searched different spaces: {async_space} vs {batch_space}")

    ranks = next((int(e.split("=")[1]) for e in args.extra if e.startswith("dist.nproc_per_node=")), 1)
    batch = summarize(batch_rows, batch_wall, None, ranks)
    target = batch["best_objective"]
    batch = summarize(batch_rows, batch_wall, target, ranks, args.tolerance)
    async_ = summarize(async_rows, async_wall, target, ranks, args.tolerance)
    batch_params = {r["number"]: r["params"] for r in batch_rows}
    for r in async_rows:
        r["same_params_as_batch"] = r["params"] == batch_params.get(r["number"])
    arms = {"async_pruning": async_, "batch_sync_no_pruning": batch}
    rows_of = {"async_pruning": async_rows, "batch_sync_no_pruning": batch_rows}
    if pool is not None:  # device-seconds: what the workers held, idle included
        pool_rows, pool_wall, _, spans = pool
        warm = summarize(pool_rows, pool_wall, target, ranks, args.tolerance)
        warm["device_seconds"] = round(pool_device_seconds(spans, pool_wall), 2)
        for key, goal in (("device_s_to_batch_best", target), ("device_s_to_near_batch_best", target * (1 + args.tolerance))):
            hits = [r["ended"] for r in pool_rows if r["state"] == "COMPLETE" and r["objective"] <= goal]
            warm[key] = round(pool_device_seconds(spans, min(hits)), 2) if hits else None
        warm["workers"] = spans
        arms["warm_workers"], rows_of["warm_workers"] = warm, pool_rows
    for name, m in arms.items():  # start-up seconds: every trial's, and the warm ones' (a worker's later trials)
        m["startup_s_median"] = median([r["startup_s"] for r in rows_of[name] if r.get("startup_s") is not None])
        m["startup_s_median_warm"] = median([r["startup_s"] for r in rows_of[name] if r.get("start") == "warm"])

    def fmt(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    print(f"\n{'arm':<22} {'wall s':>7} {'trial-s':>8} {'best':>8} {'s to own best':>13} {'s to batch best':>15} "
          f"{'device-s to batch best':>22} {'pruned':>6} {'failed':>6}")
    for name, m in arms.items():
        print(f"{name:<22} {m['wall_s']:>7.1f} {m['trial_seconds']:>8.1f} {fmt(m['best_objective'], '.4f'):>8} "
              f"{fmt(m['s_to_own_best'], '.1f'):>13} {fmt(m['s_to_batch_best'], '.1f'):>15} "
              f"{fmt(m['device_s_to_batch_best'], '.1f'):>22} {m['pruned']:>6} {m['failed']:>6}")
    ratio = (async_["device_s_to_batch_best"] / batch["device_s_to_batch_best"]
             if async_["device_s_to_batch_best"] is not None and batch["device_s_to_batch_best"] else None)
    near = (async_["device_s_to_near_batch_best"] / batch["device_s_to_near_batch_best"]
            if async_["device_s_to_near_batch_best"] is not None and batch["device_s_to_near_batch_best"] else None)
    print(f"device-seconds to reach the batch arm's best, async / batch: {fmt(ratio, '.3f')}; to come within "
          f"{100 * args.tolerance:g}% of it: {fmt(near, '.3f')} (async {fmt(async_['device_s_to_near_batch_best'], '.1f')} "
          f"device-s, batch {fmt(batch['device_s_to_near_batch_best'], '.1f')})")
    for name, m in arms.items():
        print(f"{name}: {m['device_seconds']:.1f} device-s ({m['device_seconds'] / batch['device_seconds']:.2f}x the batch "
              f"arm's); trial start-up median {fmt(m['startup_s_median'], '.2f')} s, warm trials "
              f"{fmt(m['startup_s_median_warm'], '.2f')} s")
    warm_ratio = near_warm = None
    if "warm_workers" in arms:
        warm = arms["warm_workers"]
        warm_ratio = warm["device_seconds"] / batch["device_seconds"]
        near_warm = (warm["device_s_to_near_batch_best"] / batch["device_s_to_near_batch_best"]
                     if warm["device_s_to_near_batch_best"] is not None and batch["device_s_to_near_batch_best"] else None)
        print(f"warm workers / batch: {warm_ratio:.3f} of the device-seconds (goal <= 0.4); to come within "
              f"{100 * args.tolerance:g}% of the batch best: {fmt(near_warm, '.3f')}")
    same = sum(r["same_params_as_batch"] for r in async_rows)
    print(f"{same}/{len(async_rows)} async trials have the same params as the batch trial with the same number "
          "(the samplers see different histories, so the trials may differ)")
    for name, rows in (("async", async_rows), ("batch", batch_rows), ("warm", rows_of.get("warm_workers", []))):
        for r in rows:
            params = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["params"].items())
            print(f"  {name} {r['number']:>2} {r['state']:<8} {fmt(r['objective'], '.4f'):>8} "
                  f"[{r['started']:>6.1f}, {fmt(r['ended'], '6.1f')}] s  start-up {fmt(r['startup_s'], '.2f')} s "
                  f"({r['start']})  {params}")

    report = {
        "benchmark": "sweep_async",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": git_sha(), "host": platform.node(), "python": platform.python_version(),
        "cpus": len(os.sched_getaffinity(0)),
        "settings": {
            "search": f"hparams_search={SEARCH}", "n_trials": n, "concurrency": c, "seed": seed, "extra": args.extra,
            "trial_threads": int(trial_env(c)["OMP_NUM_THREADS"]), "space": batch_space,
            "sweeper": {k: v for k, v in sweeper_yaml().items() if k != "params"},
            "order": ["async_pruning", "batch_sync_no_pruning", *(["warm_workers"] if args.workers else [])],
            "workers": args.workers,
            "async_teacher": f"cache ({args.cache_method}, built by its first trial)" if args.cache else "live",
            "batch_teacher": "live",
        },
        "device_s_to_batch_best_ratio": ratio,
        "tolerance": args.tolerance,
        "device_s_to_near_batch_best_ratio": near,
        "warm_workers_device_s_ratio": warm_ratio,
        "warm_workers_device_s_to_near_batch_best_ratio": near_warm,
        "notes": [
            "times are seconds from the arm's start (the async arm: launching the sweep command, which includes "
            "composing and validating the search space's corners)",
            "s_to_batch_best: the first completed trial whose objective <= the batch arm's best (null: never)",
            "the samplers see different histories (pruned trials, result order), so the arms' trials may differ "
            "after TPE's random start-up trials; see same_params_as_batch",
            "the batch arm polls its processes every 0.1 s, kdsweep every poll_s (0.5 s by default)",
        ],
        "arms": arms,
        "trials": rows_of,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
