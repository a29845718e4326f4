"""Does distillation help on the embedded default? Same student, steps, data and seed; kd_ratio 0 vs 0.5.

Each arm is a whole `python -m kdsweep` process; the held-out student CE of each is read from its run.json.
    python benchmarks/kd_vs_ce.py [--out benchmarks/results/kd_vs_ce.json] [extra overrides...]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = {"ce_only": "kd_ratio=0.0", "distilled": "kd_ratio=0.5"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "kd_vs_ce.json"))
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides applied to both arms")
    args = parser.parse_args()

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm, knob in ARMS.items():
            run_dir = Path(tmp) / arm
            t0 = time.perf_counter()
            cmd = [sys.executable, "-m", "kdsweep", knob, "logger=quiet", f"hydra.run.dir={run_dir}", *args.overrides]
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            record = json.loads((run_dir / "run.json").read_text())
            results[arm] = {
                "override": knob,
                "heldout_ce_before": record["eval_before"]["student_ce"],
                "heldout_ce_after": record["objective"],
                "teacher_ce": record["eval_after"]["teacher_ce"],
                "kl_to_teacher_after": record["eval_after"]["kl"],
                "steps": record["steps"],
                "wall_s": round(time.perf_counter() - t0, 1),
            }
    report = {
        "benchmark": "kd_vs_ce",
        "overrides": args.overrides,
        "host": platform.node(),
        "python": platform.python_version(),
        "results": results,
        "distilled_minus_ce_only": results["distilled"]["heldout_ce_after"] - results["ce_only"]["heldout_ce_after"],
    }
    print(f"{'arm':<10} {'kd_ratio':>8} {'CE before':>10} {'CE after':>10} {'teacher CE':>11} {'wall s':>7}")
    for arm, r in results.items():
        print(f"{arm:<10} {r['override'].split('=')[1]:>8} {r['heldout_ce_before']:>10.4f} {r['heldout_ce_after']:>10.4f} "
              f"{r['teacher_ce']:>11.4f} {r['wall_s']:>7}")
    print(f"distilled - ce_only = {report['distilled_minus_ce_only']:+.4f} (negative: distillation helps)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
