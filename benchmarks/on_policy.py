"""On-policy distillation (GKD's λ) and sequence-level KD against plain KD on the data, same steps and seeds.

Data: instruction rows cut from the embedded corpus ("Continue the text." + a sentence -> the next sentence), packed
into 128-token rows; the embedded teacher and student. Arms: lmbda 0, 0.5 and 1 (the student completes that share
of the steps' prompts, up to --max-new-tokens tokens), and rollout.seq_kd=true at lmbda 0 (the teacher completes
them). Per arm and seed: the held-out student CE on the gold outputs (the objective) and KL(teacher ‖ student) on
them, and the throughput: median step time, the share of it spent generating, generated tokens per step. Whole
``python -m kdsweep`` processes, one thread each, arms interleaved within each seed.

Also: λ = 0 on the embedded default (text) against the objective recorded before generation existed
(benchmarks/results/teacher_cache.json, arm "live": the same job), to every digit.

    python benchmarks/on_policy.py [--seeds 0 1] [--steps 60] [--out benchmarks/results/on_policy.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ARMS = {"lmbda_0": ["lmbda=0"], "lmbda_0.5": ["lmbda=0.5"], "lmbda_1": ["lmbda=1"],
        "seq_kd": ["lmbda=0", "rollout.seq_kd=true"]}


def instructions(out: Path) -> Path:
    rows = []
    for line in (REPO / "kdsweep" / "data" / "corpus" / "kjv.txt").read_text().splitlines():
        sentences = [s for s in re.split(r"(?<=[.;:])\s+", line) if 4 <= len(s.split()) <= 25]
        rows += [{"instruction": "Continue the text.", "input": a, "output": b} for a, b in zip(sentences, sentences[1:])]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def kdsweep(args: list[str], work: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kdsweep", *args, "logger=quiet"], cwd=work, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"kdsweep {' '.join(args)} failed:\n{proc.stderr[-3000:]}")


def summary(run_dir: Path) -> dict[str, Any]:
    record = json.loads((run_dir / "run.json").read_text())
    train = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    generated = [r for r in train if r.get("rollout") in ("student", "teacher")]
    return {"objective": record["objective"], "kl_after": record["eval_after"]["kl"],
            "student_ce_before": record["eval_before"]["student_ce"], "teacher_ce": record["eval_after"]["teacher_ce"],
            "step_s": statistics.median(r["step_s"] for r in train[2:]),
            "generated_steps": len(generated), "steps": len(train),
            "generation_share": statistics.mean(r["generation_share"] for r in generated) if generated else 0.0,
            "generated_tokens_per_step": statistics.mean(r["generated_tokens"] for r in generated) if generated else 0,
            "mean_completion_len": statistics.mean(r["mean_completion_len"] for r in generated) if generated else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "on_policy.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kdsweep-onpolicy-"))
    data = instructions(work / "continue.jsonl")
    common = ["data=instruction", f"data.datasets.0.path={data}", "data.seq_len=128", "data.batch_size=16",
              "data.micro_batch_size=8", "data.max_eval_sequences=32", f"train.max_steps={args.steps}",
              f"train.eval_every={args.steps}", f"rollout.max_new_tokens={args.max_new_tokens}",
              "checkpoint.save_every=0", "checkpoint.export_merged=false", "checkpoint.export_adapter=false"]
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for seed in args.seeds:
        for arm, extra in ARMS.items():
            run_dir = work / f"{arm}_s{seed}"
            kdsweep([*common, *extra, f"train.seed={seed}", f"rollout.seed={seed}", f"hydra.run.dir={run_dir}"], work)
            runs[arm].append(summary(run_dir))
            r = runs[arm][-1]
            print(f"  seed {seed} {arm:<10} objective {r['objective']:.4f}  KL {r['kl_after']:.4f}  step "
                  f"{r['step_s']:.3f} s  generating {100 * r['generation_share']:.0f}%", flush=True)
    med = {arm: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for arm, rs in runs.items()}
    base = med["lmbda_0"]
    for arm in med.values():
        arm["step_s_vs_lmbda_0"] = arm["step_s"] / base["step_s"]
    best = min(med, key=lambda a: med[a]["objective"])
    closest = min(med, key=lambda a: med[a]["kl_after"])

    default_dir = work / "embedded_default"  # lambda 0 on the embedded default, against the recorded objective
    kdsweep(["kd_ratio=0.5", f"hydra.run.dir={default_dir}"], work)
    recorded = json.loads((REPO / "benchmarks" / "results" / "teacher_cache.json").read_text())
    before = recorded["accuracy"]["arms"]["live"]["objective"]
    now = json.loads((default_dir / "run.json").read_text())["objective"]

    result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "settings": {"seeds": args.seeds, "steps": args.steps, "max_new_tokens": args.max_new_tokens,
                           "common": common},
              "runs": runs, "median": med, "best_objective": best, "closest_to_teacher": closest,
              "lmbda_0_embedded_default": {"objective": now, "recorded_before_rollout": before,
                                           "identical": now == before}}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"\nmedian over seeds {args.seeds}:")
    for arm, m in med.items():
        print(f"  {arm:<10} held-out CE {m['objective']:.4f}  KL {m['kl_after']:.4f}  step {m['step_s']:.3f} s "
              f"({m['step_s_vs_lmbda_0']:.2f}x lmbda 0, {100 * m['generation_share']:.0f}% generating, "
              f"{m['generated_tokens_per_step']:.0f} tokens/step)")
    print(f"best held-out CE: {best}; lowest KL to the teacher: {closest}")
    print(f"lmbda 0 on the embedded default: {now!r} vs {before!r} recorded before (identical: {now == before})")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
