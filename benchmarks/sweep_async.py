"""A sweep's answer at equal device-seconds: kdsweep's search (warm workers, teacher-logit cache, a pruner) against
the batch-synchronous, unpruned, live-teacher search a hand-glued Hydra + Optuna sweep runs, over sweep seeds.

Per sweep seed (``--seeds``), on the embedded default with ``hparams_search=kd_optuna``:

- ``batch``: what hydra-optuna-sweeper does with a parallel launcher: ask ``--concurrency`` trials from a TPE study
  with that seed and a NopPruner, run them as concurrent ``python -m kdsweep`` processes with the live teacher
  (OMP_NUM_THREADS = cores // concurrency, as kdsweep's local backend), wait for the whole batch, tell, repeat;
  ``--n-trials`` trials. Its device-seconds (every trial's wall time × ranks) are the seed's **budget**.
- ``kdsweep/<pruner>`` for each of ``--pruners``: the real ``python -m kdsweep -m hparams_search=kd_optuna`` with
  ``hydra.sweeper.budget`` = that budget, ``n_trials`` null, ``--workers`` warm workers and the teacher-logit cache
  (``sample``, built by its first trial, inside the budget); device-seconds as kdsweep counts them (its workers'
  hold on the cores from launch to leaving, idle included). ``halving`` is Optuna's successive halving with a grace
  period (``halving:20``: no trial pruned before step 20, ``hydra.sweeper.pruner_warmup_steps``); ``percentile:0``
  the rule shipped before (the worst quarter at any eval), ``percentile:20`` the same with the grace period.
- **confirmation**, alike for every arm and outside the budget (the kdsweep arms run with ``confirm.top=0``), as
  kdsweep's own confirmation does it (``kdsweep.sweep.confirm``): each arm's winner (its best completed trial on the
  eval split) trained again with ``--confirm-seeds`` fresh seeds (``train.seed`` = ``rollout.seed`` = 1000, 1001, …),
  the live teacher, and scored on the **test split** no search trial read (``data.test_fraction`` of ``kd_optuna``):
  the mean and 95% interval that the user would act on. Against it, the **fair baseline**: CE-only
  (``kd_ratio=0``, no generation, no sequence-level KD) at a learning rate of its own (``--baseline-trials``
  CE-only trials log-uniform over the searched range, the best on the eval split), on the same seeds and test split;
  each winner's paired difference to it, with its 95% interval and t. The **seed noise** is the pooled standard
  deviation over seeds of every confirmed point (test split).
- **late bloomers**: every trial a pruner stopped is run again to its end (seed 0, as in its sweep) to learn what
  it would have reached: a pruner *cut the eventual best* when one of them ends better than its arm's best.

Reported per seed and arm: the best objective found (eval split), the device-seconds until the arm first completed a
trial within the seed noise of the batch arm's best, the confirmed mean ± 95% of its winner on the test split and its
paired difference to the fair baseline, trials run, pruned, and the
pruned trials that would have beaten its best. Then, over seeds, the medians the README quotes. Arms run one after
the other, never side by side; the confirmation and late-bloomer runs come after them.

    python benchmarks/sweep_async.py [--seeds 0 1 2] [--n-trials 16] [--concurrency 2] [--workers 2]
                                     [--pruners halving:20 percentile:0 percentile:20 none] [--confirm-seeds 3]
                                     [--baseline-trials 4]
                                     [--extra OVERRIDE ...] [--out benchmarks/results/sweep_async.json] [--keep DIR]
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
SEARCH = "kd_optuna"
UNBIASED = ["teacher.logits=live", "train.eval_test=true"]  # kdsweep.sweep.confirm.UNBIASED, as a confirmation seed
CE_ONLY = ["kd_ratio=0.0", "rollout.lmbda=0.0", "rollout.seq_kd=false"]  # kdsweep.sweep.confirm.CE_ONLY's knobs


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


def summarize(rows: list[dict[str, Any]], wall_s: float, spent: Any) -> dict[str, Any]:
    """An arm's metrics from its trial rows (times relative to its start); ``spent(t)``: its device-seconds at t."""
    done = [r for r in rows if r["state"] == "COMPLETE"]
    best = min(done, key=lambda r: (r["objective"], r["ended"])) if done else None
    return {
        "wall_s": round(wall_s, 2), "device_seconds": round(spent(wall_s), 2),
        "best_objective": best["objective"] if best else None, "best_trial": best["number"] if best else None,
        "best_params": best["params"] if best else None,
        "trials": len(rows), "complete": len(done), "pruned": sum(r["state"] == "PRUNED" for r in rows),
        "failed": sum(r["state"] == "FAIL" for r in rows),
    }


def first_within(rows: list[dict[str, Any]], goal: float, spent: Any) -> float | None:
    """Device-seconds until the arm first completed a trial at or below ``goal`` (None: never)."""
    hits = [r["ended"] for r in rows if r["state"] == "COMPLETE" and r["objective"] <= goal]
    return round(spent(min(hits)), 2) if hits else None


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


def run_async(work: Path, arm: str, seed: int, c: int, sweeper: list[str],
              extra: list[str]) -> tuple[list[dict[str, Any]], float, list[str], float]:
    """The real sweep command; its trials from sweep.json, times relative to the launch (also returned)."""
    sweep_dir = work / arm
    cmd = [sys.executable, "-m", "kdsweep", "-m", f"hparams_search={SEARCH}", f"hydra.sweep.dir={sweep_dir}",
           f"hydra.sweeper.max_concurrent={c}", f"hydra.sweeper.seed={seed}", *sweeper, *extra]
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(work / f"{arm.replace('/', '-')}.log", "wb") as out:
        proc = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    if proc.returncode != 0:
        tail = (work / f"{arm.replace('/', '-')}.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"the sweep {arm} failed ({proc.returncode}):\n{tail}")
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


def run_points(work: Path, points: list[tuple[str, dict[str, Any], list[str]]], c: int) -> dict[str, dict[str, Any]]:
    """Each ``(name, params, overrides)`` as one ``python -m kdsweep`` job, ``c`` at a time: objective (on the test
    split when it was scored on it, else the eval split's), the eval split's, and seconds."""
    env, out, queue, running = trial_env(c), {}, list(points), {}
    while queue or running:
        while queue and len(running) < c:
            name, params, overrides = queue.pop(0)
            run_dir = work / "points" / name
            shutil.rmtree(run_dir, ignore_errors=True)  # a finished run directory would be resumed: no step
            run_dir.mkdir(parents=True)
            cmd = [sys.executable, "-m", "kdsweep", f"hparams_search={SEARCH}", *overrides,
                   *(f"{k}={v}" for k, v in params.items()), f"hydra.run.dir={run_dir}"]
            with open(run_dir / "job.log", "wb") as log:
                running[name] = (subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env),
                                 run_dir, time.time(), overrides)
        for name, (proc, run_dir, started, _) in list(running.items()):
            if proc.poll() is not None:
                on_test = "train.eval_test=true" in running[name][3]
                state, value, reason = read_objective(run_dir, proc.returncode, "test" if on_test else "eval")
                out[name] = {"state": state, "objective": value, "seconds": round(time.time() - started, 2),
                             "reason": reason, "eval": read_objective(run_dir, proc.returncode, "eval")[1]}
                del running[name]
        time.sleep(0.2)
    return out


def interval(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and the half-width of its 95% Student-t interval."""
    if len(values) < 2:
        return (values[0] if values else None), None
    from scipy.stats import t as student_t

    return statistics.fmean(values), float(student_t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))


def read_objective(run_dir: Path, code: int, split: str = "eval") -> tuple[str, float | None, str | None]:
    """A finished job's state, its objective on ``split`` (eval: the search's; test: a confirmation's) and why not."""
    record_path = run_dir / "run.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    value = (record.get(f"{split}_after") or {}).get("student_ce")
    if code == 0 and record.get("status") == "completed" and value is not None and math.isfinite(value):
        return "COMPLETE", float(value), None
    return "FAIL", None, record.get("error") or f"exit {code}, status {record.get('status')}"


def paired(a: list[float | None], b: list[float | None]) -> dict[str, Any]:
    """a − b over the seeds both completed: mean, unadjusted 95% half-width, t and the seeds."""
    diffs = [x - y for x, y in zip(a, b) if x is not None and y is not None]
    mean, half = interval(diffs)
    sd = statistics.stdev(diffs) if len(diffs) > 1 else None
    t = None if not sd else mean / (sd / math.sqrt(len(diffs)))
    return {"mean": mean, "ci95": half, "t": t, "seeds": len(diffs)}


def baseline_lrs(space: list[dict[str, Any]], seed: int, n: int) -> list[float]:
    """``n`` learning rates log-uniform over the searched range, drawn from the sweep seed (as kdsweep's plan)."""
    lr = next(p for p in space if p["key"] in ("lr", "optim.lr"))
    low, high = lr["low"], lr["high"]
    draw = random.Random(f"{seed}:ce_lr")
    return sorted(math.exp(draw.uniform(math.log(low), math.log(high))) for _ in range(n))


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
            state, value, reason = read_objective(run_dir, proc.returncode, "eval")
            if state == "COMPLETE":
                study.tell(trial, value)
            else:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            rows.append({"number": number, "params": trial.params, "state": state, "objective": value,
                         "started": round(started - t0, 2), "ended": round(ended[number] - t0, 2),
                         "attempts": 1, "reason": reason, **startup(run_dir)})
    return rows, time.time() - t0, json.loads(json.dumps([p.describe() for p in space]))  # as in sweep.json


def one_seed(work: Path, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every arm of one sweep seed, the confirmation of their winners and the late-bloomer runs."""
    c, extra = args.concurrency, args.extra
    print(f"seed {seed}: batch arm, {args.n_trials} trials in batches of {c}, no pruning, live teacher", flush=True)
    batch_rows, batch_wall, space = run_batch(work, args.n_trials, c, seed, extra)
    spent_batch = lambda t: device_seconds(batch_rows, t, 1)  # noqa: E731
    budget = spent_batch(batch_wall)
    arms = {"batch": (batch_rows, batch_wall, spent_batch)}
    for spec in args.pruners:
        pruner, _, grace = spec.partition(":")
        arm = f"kdsweep/{pruner}" + (f"-grace{grace}" if grace and grace != "0" else "")
        print(f"seed {seed}: {arm}, budget {budget:.0f} device-s, {args.workers} warm workers, cache", flush=True)
        sweeper = ["hydra.sweeper.n_trials=null", f"hydra.sweeper.budget={budget / 3600:.8f}",
                   "hydra.sweeper.confirm.top=0",  # every arm's winner is confirmed alike, below
                   f"hydra.sweeper.workers={args.workers}", f"hydra.sweeper.pruner={pruner}",
                   f"hydra.sweeper.pruner_warmup_steps={grace or 0}"]
        cache = ["teacher.logits=cache", "teacher.cache.method=sample", f"teacher.cache.dir={work / arm / 'cache'}"]
        rows, wall, arm_space, t0 = run_async(work, arm, seed, c, sweeper, [*extra, *cache])
        if arm_space != space:
            raise SystemExit(f"{arm} searched another space: {arm_space} vs {space}")
        spans = pool_spans(work / arm, t0)
        arms[arm] = (rows, wall, lambda t, spans=spans: pool_device_seconds(spans, t))
    metrics = {name: summarize(rows, wall, spent) for name, (rows, wall, spent) in arms.items()}

    # the CE-only learning rates (eval split, the search's seed), then the winners and the fair baseline trained
    # again with fresh seeds and the live teacher on the test split; then each pruned trial to its end
    lrs = baseline_lrs(space, seed, args.baseline_trials)
    print(f"seed {seed}: {len(lrs)} CE-only learning-rate runs", flush=True)
    ce_runs = run_points(work, [(f"ce_lr{i}", {"lr": lr}, [*extra, *CE_ONLY]) for i, lr in enumerate(lrs)], c)
    ce_done = [(r["objective"], lrs[i]) for i, r in enumerate(ce_runs[f"ce_lr{i}"] for i in range(len(lrs)))
               if r["objective"] is not None]
    ce_lr = min(ce_done)[1]
    seeded = lambda k: [*extra, f"train.seed={1000 + k}", f"rollout.seed={1000 + k}", *UNBIASED]  # noqa: E731
    winners = list({json.dumps(m["best_params"], sort_keys=True): m["best_params"]  # arms that agree share runs
                    for m in metrics.values() if m["best_params"]}.values())
    point_of = lambda params: f"winner{winners.index(params)}"  # noqa: E731
    points = [(f"{point_of(params)}-s{k}", params, seeded(k)) for params in winners for k in range(args.confirm_seeds)]
    points += [(f"ce_only-s{k}", {"lr": ce_lr}, [*seeded(k), *CE_ONLY]) for k in range(args.confirm_seeds)]
    cache_of = lambda name: ["teacher.logits=cache", "teacher.cache.method=sample",  # noqa: E731
                             f"teacher.cache.dir={work / name / 'cache'}"]
    pruned = [(f"{name.replace('/', '-')}-late{r['number']}", r["params"], [*extra, *cache_of(name)])
              for name, (rows, _, _) in arms.items() if name != "batch" for r in rows if r["state"] == "PRUNED"]
    print(f"seed {seed}: {len(points)} confirmation runs, {len(pruned)} pruned trials run to their end", flush=True)
    results = run_points(work, points + pruned, c)
    ce_values = [results[f"ce_only-s{k}"]["objective"] for k in range(args.confirm_seeds)]
    ce_mean, ce_half = interval([v for v in ce_values if v is not None])
    tried = [{"lr": lr, "eval": ce_runs[f"ce_lr{i}"]["objective"]} for i, lr in enumerate(lrs)]
    baseline = {"lr": ce_lr, "lr_runs": tried,
                "values": ce_values, "mean": ce_mean, "ci95": ce_half,
                "eval_values": [results[f"ce_only-s{k}"]["eval"] for k in range(args.confirm_seeds)]}
    confirmed = {}
    for name, m in metrics.items():
        runs = ([results[f"{point_of(m['best_params'])}-s{k}"] for k in range(args.confirm_seeds)]
                if m["best_params"] else [])
        values = [r["objective"] for r in runs]
        mean, half = interval([v for v in values if v is not None])
        confirmed[name] = [v for v in values if v is not None]
        m["confirmed"] = {"values": values, "mean": mean, "ci95": half, "split": "test",
                          "eval_values": [r["eval"] for r in runs], "vs_ce_only": paired(values, ce_values)}
    by_point = {json.dumps(metrics[name]["best_params"], sort_keys=True): v for name, v in confirmed.items() if len(v) > 1}
    by_point["ce_only"] = [v for v in ce_values if v is not None]
    noise = math.sqrt(statistics.fmean(statistics.variance(v) for v in by_point.values()))
    goal = metrics["batch"]["best_objective"] + noise
    for name, (rows, wall, spent) in arms.items():
        m = metrics[name]
        m["device_s_to_within_noise_of_batch_best"] = first_within(rows, goal, spent)
        late = [{"number": r["number"], "pruned_at_s": r["ended"],
                 "would_have_reached": results[f"{name.replace('/', '-')}-late{r['number']}"]["objective"]}
                for r in rows if r["state"] == "PRUNED"]
        m["late_bloomers"] = [x for x in late if x["would_have_reached"] is not None
                              and x["would_have_reached"] < m["best_objective"]]
        m["pruned_runs"] = late
        m["cut_the_eventual_best"] = bool(m["late_bloomers"])
        m["ratio_to_batch"] = (None if m["device_s_to_within_noise_of_batch_best"] is None else round(
            m["device_s_to_within_noise_of_batch_best"] / metrics["batch"]["device_s_to_within_noise_of_batch_best"], 3))
    return {"seed": seed, "budget_device_s": round(budget, 2), "seed_noise_sd": noise, "within_noise_goal": goal,
            "baseline": baseline, "arms": metrics, "trials": {name: rows for name, (rows, _, _) in arms.items()}, "space": space}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--n-trials", type=int, default=16, help="the batch arm's trials (its spend is the budget)")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pruners", nargs="+", default=["halving:20", "percentile:0", "percentile:20", "none"],
                        help="kdsweep arms: pruner[:grace steps] (hydra.sweeper.pruner_warmup_steps)")
    parser.add_argument("--confirm-seeds", type=int, default=3)
    parser.add_argument("--baseline-trials", type=int, default=4, help="CE-only learning rates tried for the baseline")
    parser.add_argument("--extra", action="append", default=[], metavar="OVERRIDE",
                        help="a Hydra override for every trial of every arm (repeat it)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "sweep_async.json"))
    parser.add_argument("--keep", default=None, help="keep the arms' run directories here (default: a temp dir)")
    args = parser.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="sweep_async-")).resolve()
    seeds: list[dict[str, Any]] = []
    try:
        for seed in args.seeds:  # the report is saved after every seed: an interrupted run keeps what it measured
            seeds.append(one_seed(root / f"seed{seed}", seed, args))
            save(report(seeds, args), args.out)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print_table(seeds)
    print(f"saved {args.out}")


def fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(seeds: list[dict[str, Any]]) -> None:
    names = list(seeds[0]["arms"])
    print(f"\n{'seed':>4} {'arm':<22} {'budget':>7} {'spent':>7} {'best':>7} {'to noise':>9} {'ratio':>6} "
          f"{'confirmed':>16} {'trials':>6} {'pruned':>6} {'late':>5}")
    for s in seeds:
        for name in names:
            m = s["arms"][name]
            conf = m["confirmed"]
            print(f"{s['seed']:>4} {name:<22} {s['budget_device_s']:>7.0f} {m['device_seconds']:>7.0f} "
                  f"{fmt(m['best_objective'], '.4f'):>7} {fmt(m['device_s_to_within_noise_of_batch_best'], '.0f'):>9} "
                  f"{fmt(m['ratio_to_batch'], '.2f'):>6} {fmt(conf['mean'], '.4f'):>7} ± {fmt(conf['ci95'], '.4f'):<6} "
                  f"{m['trials']:>6} {m['pruned']:>6} {len(m['late_bloomers']):>5}  vs CE-only "
                  f"{fmt(conf['vs_ce_only']['mean'], '+.4f')} ± {fmt(conf['vs_ce_only']['ci95'], '.4f')}")
        b = s["baseline"]
        print(f"{s['seed']:>4} {'CE-only lr ' + format(b['lr'], '.3g'):<22} {'':>7} {'':>7} {'':>7} {'':>9} {'':>6} "
              f"{fmt(b['mean'], '.4f'):>7} ± {fmt(b['ci95'], '.4f'):<6}")
    for name, row in summarize_seeds(seeds).items():
        print(f"{name}: device-s to within noise of the batch best / batch's, median {row['median_ratio_to_batch']} "
              f"{row['ratios']}; as good as batch {row['at_least_as_good_as_batch']}; cut the eventual best in "
              f"{row['seeds_that_cut_the_eventual_best']} of {len(seeds)} seeds; device-s {row['device_seconds']}")


def summarize_seeds(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    summary = {}
    for name in seeds[0]["arms"]:
        arms = [s["arms"][name] for s in seeds]
        ratios = [a["ratio_to_batch"] for a in arms]
        summary[name] = {
            "median_ratio_to_batch": median([r for r in ratios if r is not None]) if all(r is not None for r in ratios) else None,
            "ratios": ratios,
            "at_least_as_good_as_batch": [a["best_objective"] is not None and
                                          a["best_objective"] <= s["arms"]["batch"]["best_objective"]
                                          for a, s in zip(arms, seeds)],
            "seeds_that_cut_the_eventual_best": sum(a["cut_the_eventual_best"] for a in arms),
            "confirmed_means": [a["confirmed"]["mean"] for a in arms],
            "vs_ce_only": [a["confirmed"]["vs_ce_only"] for a in arms],
            "device_seconds": [a["device_seconds"] for a in arms],
            "trials": [a["trials"] for a in arms], "pruned": [a["pruned"] for a in arms],
        }
    return summary


def report(seeds: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    return {
        "benchmark": "sweep_async", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": git_sha(), "host": platform.node(), "python": platform.python_version(),
        "cpus": len(os.sched_getaffinity(0)),
        "settings": {"search": f"hparams_search={SEARCH}", "seeds": args.seeds, "n_trials": args.n_trials,
                     "concurrency": args.concurrency, "workers": args.workers, "pruners": args.pruners,
                     "confirm_seeds": args.confirm_seeds, "baseline_trials": args.baseline_trials,
                     "extra": args.extra,
                     "trial_threads": int(trial_env(args.concurrency)["OMP_NUM_THREADS"]),
                     "sweeper": {k: v for k, v in sweeper_yaml().items() if k != "params"}},
        "notes": ["budget: the batch arm's device-seconds (its trials' wall time); kdsweep's arms spend it as kdsweep "
                  "counts (workers' hold from launch to leaving, idle and the cache build included)",
                  "seed noise: the pooled standard deviation over training seeds of every confirmed point (test split)",
                  "confirmation: live teacher, train.seed = rollout.seed = 1000.., scored on the test split "
                  "(data.test_fraction 0.05 of kd_optuna; every arm trains without those rows); the fair baseline: "
                  "CE-only at the best of --baseline-trials learning rates on the eval split, lora_rank 8",
                  "late bloomers: pruned trials that, run to their end, beat their arm's best"],
        "summary": summarize_seeds(seeds), "seeds": seeds,
    }


def save(data: dict[str, Any], out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(data, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
