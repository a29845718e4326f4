"""Does a teacher with another tokenizer distil? The embedded default, same student, steps, data, seeds 0–2.

Arms, each a whole `python -m kdsweep` process (one thread), interleaved seed by seed:
- ce_only: kd_ratio=0 (no teacher term);
- same_tokenizer: the tiny teacher (the student's own tokenizer), kd_ratio=0.5;
- cross_gold / cross_uld: the second teacher (teacher=tiny_other: the tiny teacher's architecture and recipe in its
  own SentencePiece-style BPE of 1536 pieces), kd_ratio=0.5, loss.cross_tokenizer=gold / uld.
Reported per arm: the median over seeds of the held-out student CE after training (the objective: CE on the
student's own gold labels, comparable across arms), the teacher's CE as each run reports it, and wall seconds.

    python benchmarks/cross_tokenizer.py [--seeds 0 1 2] [--out benchmarks/results/cross_tokenizer.json] [overrides...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = {
    "ce_only": ["kd_ratio=0.0"],
    "same_tokenizer": ["kd_ratio=0.5"],
    "cross_gold": ["kd_ratio=0.5", "teacher=tiny_other", "loss.cross_tokenizer=gold"],
    "cross_uld": ["kd_ratio=0.5", "teacher=tiny_other", "loss.cross_tokenizer=uld"],
}


def run(arm: str, seed: int, work: Path, overrides: list[str]) -> dict:
    run_dir = work / f"{arm}-{seed}"
    cmd = [sys.executable, "-m", "kdsweep", *ARMS[arm], f"train.seed={seed}", "train.threads=1", "logger=quiet",
           f"hydra.run.dir={run_dir}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{arm} seed {seed} failed:\n{proc.stderr[-3000:]}")
    record = json.loads((run_dir / "run.json").read_text())
    return {"seed": seed, "heldout_ce_before": record["eval_before"]["student_ce"], "heldout_ce_after": record["objective"],
            "teacher_ce": record["eval_after"]["teacher_ce"], "distance_after": record["eval_after"]["kl"],
            "steps": record["steps"], "alignment": record.get("alignment"), "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "cross_tokenizer.json"))
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides applied to every arm")
    args = parser.parse_args()

    rows: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:  # interleaved: every arm of a seed before the next seed
            for arm in ARMS:
                rows[arm].append(run(arm, seed, Path(tmp), args.overrides))
                print(f"{arm:<15} seed {seed}: held-out CE {rows[arm][-1]['heldout_ce_after']:.4f}", flush=True)
    median = lambda arm, key: statistics.median(r[key] for r in rows[arm])
    summary = {arm: {"heldout_ce_after_median": median(arm, "heldout_ce_after"),
                     "heldout_ce_before_median": median(arm, "heldout_ce_before"),
                     "teacher_ce_median": median(arm, "teacher_ce"), "wall_s_median": median(arm, "wall_s")}
               for arm in ARMS}
    ce = summary["ce_only"]["heldout_ce_after_median"]
    for arm in ARMS:
        summary[arm]["minus_ce_only"] = summary[arm]["heldout_ce_after_median"] - ce
    report = {"benchmark": "cross_tokenizer", "seeds": args.seeds, "overrides": args.overrides, "arms": ARMS,
              "host": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count(),
              "summary": summary, "runs": rows}
    print(f"\n{'arm':<15} {'CE after (median)':>18} {'- ce_only':>10} {'teacher CE':>11} {'wall s':>7}")
    for arm, s in summary.items():
        print(f"{arm:<15} {s['heldout_ce_after_median']:>18.4f} {s['minus_ce_only']:>+10.4f} "
              f"{s['teacher_ce_median']:>11.4f} {s['wall_s_median']:>7}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
