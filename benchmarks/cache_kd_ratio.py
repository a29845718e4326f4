"""How far a trial trained from the teacher-logit cache lands from the live teacher's, as ``kd_ratio`` grows.

benchmarks/sweep_async.py found that a sweep on the ``sample`` cache ranked high-``kd_ratio`` points worse than the
live teacher trains them. This measures it: the embedded default at each ``--kd-ratios`` (and ``--extra``
overrides, e.g. the sweep's learning rate), trained with the live teacher and from a ``full``, ``sample`` and
``topk`` cache (k = ``--k``), over ``--seeds`` training seeds; the held-out student CE (the objective) of each, and
its difference from the live teacher's on the same seed. Whole ``python -m kdsweep`` processes, 2 at a time, one
thread each; each cache is built once, before the runs that read it.

    python benchmarks/cache_kd_ratio.py [--kd-ratios 0.5 0.8 1.0] [--seeds 0 1] [--k 12] [--extra lr=0.015 ...]
                                        [--out benchmarks/results/cache_kd_ratio.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from sweep_async import git_sha, run_points  # noqa: E402  (the same whole-process runner)

METHODS = ("live", "full", "sample", "topk")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kd-ratios", type=float, nargs="+", default=[0.5, 0.8, 1.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--k", type=int, default=12)
    parser.add_argument("--extra", action="append", default=[], metavar="OVERRIDE")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "cache_kd_ratio.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cache_kd_ratio-"))

    def overrides(method: str, seed: int) -> list[str]:
        cache = [] if method == "live" else ["teacher.logits=cache", f"teacher.cache.method={method}",
                                             f"teacher.cache.k={args.k}", f"teacher.cache.dir={work / 'cache'}",
                                             "teacher.cache.rows=all"]  # one cache for every seed's rows
        return [*args.extra, f"train.seed={seed}", *cache]

    points = [(f"{method}-r{r}-s{seed}", {"kd_ratio": r}, overrides(method, seed))
              for r in args.kd_ratios for seed in args.seeds for method in METHODS]
    try:
        builds = [next(p for p in points if p[0].startswith(f"{m}-")) for m in METHODS[1:]]
        results = {}
        for point in builds:  # each cache built alone, then everything else two at a time
            results |= run_points(work, [point], 1)
        results |= run_points(work, [p for p in points if p not in builds], 2)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = {}
    print(f"{'kd_ratio':>8} {'method':<7} {'objective (per seed)':<28} {'minus live, mean':>16}")
    for r in args.kd_ratios:
        for method in METHODS:
            values = [results[f"{method}-r{r}-s{s}"]["objective"] for s in args.seeds]
            live = [results[f"live-r{r}-s{s}"]["objective"] for s in args.seeds]
            diffs = [v - l for v, l in zip(values, live) if v is not None and l is not None]
            rows[f"{method}@{r}"] = {"kd_ratio": r, "method": method, "objectives": values,
                                     "minus_live": diffs, "minus_live_mean": statistics.fmean(diffs) if diffs else None}
            shown = " ".join("-" if v is None else f"{v:.4f}" for v in values)
            print(f"{r:>8} {method:<7} {shown:<28} {rows[f'{method}@{r}']['minus_live_mean'] or 0:>+16.4f}")
    report = {"benchmark": "cache_kd_ratio",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_sha": git_sha(), "host": platform.node(), "python": platform.python_version(),
              "settings": {"kd_ratios": args.kd_ratios, "seeds": args.seeds, "k": args.k, "extra": args.extra,
                           "search": "hparams_search=kd_optuna (its train settings)"},
              "rows": rows, "runs": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
