"""What a local job costs to start, in CPU seconds: one rank, and N ranks started by the job itself.

A job of ``dist.nproc_per_node=N`` (on one machine) starts its ranks through torch's elastic launcher. Each rank
needs torch, transformers, peft and kdsweep imported: seconds of one core each, paid by every rank when ranks are
started with ``spawn``, and once per launch when they are forked from a forkserver that imported them.

Each run is a whole ``python -m kdsweep`` process (``train=smoke``, 2 steps, the embedded tiny models, nothing
exported): its wall time, and the CPU seconds of it and everything it started (``RUSAGE_CHILDREN``: a rank forked by
the forkserver is the server's child, and the server the job's, each reaped by its parent, so theirs count too).
The CPU seconds are what a machine shared by several jobs (or a test suite) pays; the difference between one rank's
and N ranks' is the price of the N-1 extra ranks. Runs of each side and rank count are interleaved; medians.

    python benchmarks/launch_cpu.py [--ranks 1 2] [--repeats 5] [--base <python of another checkout>]
        [--out benchmarks/results/launch_cpu.json]

``--base``: a second interpreter whose ``kdsweep`` is another commit (e.g. the venv ``../shared/tools/ab_step.sh``
makes for its base), run interleaved with this one, with its own cache directory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = ["train=smoke", "train.max_steps=2", "checkpoint.export_adapter=false", "checkpoint.export_merged=false",
       "checkpoint.save_every=0", "logger=quiet"]


def run_one(python: str, ranks: int, work: Path, cache: Path) -> dict[str, float]:
    """One job: its wall seconds and the CPU seconds of its whole process tree."""
    run_dir = Path(tempfile.mkdtemp(dir=work))
    dist = [] if ranks == 1 else ["dist=fsdp2_local", f"dist.nproc_per_node={ranks}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([python, "-m", "kdsweep", *JOB, *dist, f"hydra.run.dir={run_dir}"], cwd=work,
                          capture_output=True, text=True, env={**os.environ, "KDSWEEP_CACHE": str(cache)})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{python} ranks={ranks} failed: {proc.stderr.strip().splitlines()[-1:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3)}


def commit(python: str) -> str:
    """The commit of the checkout ``python`` imports kdsweep from."""
    where = subprocess.run([python, "-c", "import kdsweep, os; print(os.path.dirname(kdsweep.__file__))"],
                           capture_output=True, text=True).stdout.strip()
    return subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--base", default=None, help="the python of another checkout, run interleaved with this one")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "kdsweep-launch-cpu")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "launch_cpu.json")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    sides = {"head": sys.executable, **({"base": args.base} if args.base else {})}
    caches = {side: args.work / f"cache-{side}" for side in sides}
    for side, python in sides.items():  # the first run builds the embedded models: not counted
        run_one(python, 1, args.work, caches[side])
    samples: dict[str, dict[int, list[dict[str, float]]]] = {s: {r: [] for r in args.ranks} for s in sides}
    for _ in range(args.repeats):
        for ranks in args.ranks:
            for side, python in sides.items():
                samples[side][ranks].append(run_one(python, ranks, args.work, caches[side]))
                print(side, ranks, samples[side][ranks][-1], flush=True)
    results = {side: {str(r): {"wall_s": statistics.median(x["wall_s"] for x in runs),
                               "cpu_s": statistics.median(x["cpu_s"] for x in runs), "runs": runs}
                      for r, runs in by_rank.items()} for side, by_rank in samples.items()}
    print(f"{'side':6} {'ranks':>5} {'wall s':>8} {'CPU s':>8}")
    for side, by_rank in results.items():
        for r, m in by_rank.items():
            print(f"{side:6} {r:>5} {m['wall_s']:8.2f} {m['cpu_s']:8.2f}")
    out = {"benchmark": "launch_cpu", "date": datetime.date.today().isoformat(), "commit": commit(sys.executable),
           "base": args.base and {"python": args.base, "commit": commit(args.base)},
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "job": JOB,
           "repeats": args.repeats, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
