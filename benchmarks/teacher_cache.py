"""What the teacher-logit cache gives: accuracy of each method, step time and sweep wall time against a live teacher,
and bytes per token on disk. Whole `python -m kdsweep` processes, one thread per trial process, arms interleaved.

1. accuracy: the embedded default (kd_ratio 0.5, 60 steps), live teacher vs ``teacher.cache.method`` full, sample
   and topk at k in --ks: the held-out student CE (the objective) of each, and its relative difference from live.
2. speed: the embedded student under a synthetic teacher with at least --min-flops-ratio times its FLOPs per token
   (random weights, the embedded tokenizer; FLOPs counted below): the median step time of a trial reading a
   ``sample`` cache vs a live teacher (--repeats interleaved pairs), and an 8-trial sweep
   (``hparams_search=kd_optuna``, no pruning: the same 8 trials to the end in both arms) with the cache build
   included vs the same sweep with the live teacher.
3. bytes per token on disk of every cache built here (the embedded vocabulary, 2,048), and what each method and k
   needs per token at a 128,256-token vocabulary (Llama 3).

FLOPs per token of a decoder (forward): 2 × (its linear weights, output layer included) + 4 × layers × seq_len ×
hidden (attention scores and values, causal average taken as the full row, an upper bound).

    python benchmarks/teacher_cache.py [--ks 4 12 32] [--repeats 3] [--out benchmarks/results/teacher_cache.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TEACHER = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 6, "num_attention_heads": 4,
           "num_key_value_heads": 4, "max_position_embeddings": 512, "rope_theta": 10000.0}
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def kdsweep(args: list[str], work: Path, env: dict[str, str] | None = None) -> float:
    """Run one job or sweep; returns its wall seconds."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "kdsweep", *args, "logger=quiet"], cwd=work, capture_output=True,
                          text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise SystemExit(f"kdsweep {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return time.time() - t0


def record(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "run.json").read_text())


def flops_per_token(cfg: dict[str, Any], vocab: int, seq_len: int) -> float:
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = h * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    linear = n * (2 * h * h + 2 * h * kv + 3 * h * i) + h * vocab
    return 2 * linear + 4 * n * seq_len * h


def accuracy(work: Path, ks: list[int]) -> dict[str, Any]:
    cache = work / "accuracy_cache"
    arms = {"live": []} | {"full": ["teacher.cache.method=full"]}
    arms |= {f"{m}_k{k}": [f"teacher.cache.method={m}", f"teacher.cache.k={k}"] for m in ("sample", "topk") for k in ks}
    out: dict[str, Any] = {}
    for name, args in arms.items():
        run_dir = work / "accuracy" / name
        cached = ["teacher.logits=cache", f"teacher.cache.dir={cache}"] if name != "live" else []
        wall = kdsweep(["kd_ratio=0.5", *cached, *args, f"hydra.run.dir={run_dir}"], work)
        r = record(run_dir)
        out[name] = {"objective": r["objective"], "kl_after": r["eval_after"]["kl"], "wall_s": round(wall, 1),
                     "kl_semantics": r["teacher_targets"]["kl"]}
        print(f"  {name:<10} objective {r['objective']:.4f}", flush=True)
    live = out["live"]["objective"]
    for arm in out.values():
        arm["relative_to_live"] = (arm["objective"] - live) / live
    on_disk = {}
    for meta_path in sorted(cache.glob("*/meta.json")):
        meta = json.loads(meta_path.read_text())
        positions = sum(s["positions"] for s in meta["splits"].values())
        size = sum(f.stat().st_size for f in meta_path.parent.iterdir() if f.name != "meta.json")
        spec = meta["spec"]
        on_disk[f"{spec['method']}_k{spec['k']}" if spec["method"] != "full" else "full"] = {
            "bytes_per_token": size / positions, "positions": positions, "bytes": size, "vocab": spec["vocab"],
            "dtype": spec["dtype"], "build_s": round(meta["built"]["seconds"], 2)}
    return {"arms": out, "bytes_on_disk": on_disk}


def big_teacher(work: Path) -> Path:
    """A random-init Llama teacher with the embedded tokenizer, much larger than the embedded student."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kdsweep.models import zoo

    out = work / "big_teacher"
    tok = AutoTokenizer.from_pretrained(zoo.tokenizer_dir())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=False, use_cache=False, **TEACHER)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def trial_numbers(run_dir: Path) -> dict[str, float]:
    """A trial's median step time (after its third step: the first pay one-off costs), its peak memory (the
    process's peak RSS on CPU) and its start-up (job start to the first step: imports, data, teacher, student)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    train = [r for r in rows if r["kind"] == "train"]
    r = record(run_dir)
    startup = r["cost"]["trial_seconds"] - r["cost"]["loop_seconds"]
    return {"step_s": statistics.median(t["step_s"] for t in train[3:]), "peak_mem_mb": max(t["peak_mem_mb"] for t in train),
            "startup_s": startup, "teacher_s": r["timings"]["teacher_s"]}


def speed(work: Path, teacher: Path, repeats: int) -> dict[str, Any]:
    cache = work / "speed_cache"
    common = [f"teacher.path={teacher}", "teacher.zoo=null", "train.max_steps=30", "train.eval_every=100",
              "checkpoint.save_every=0", "checkpoint.export_merged=false", "checkpoint.export_adapter=false"]
    cached = ["teacher.logits=cache", f"teacher.cache.dir={cache}"]
    kdsweep([*common, *cached, f"hydra.run.dir={work / 'speed' / 'build'}"], work, ONE_THREAD)  # build it first
    trials: dict[str, list[dict[str, float]]] = {"live": [], "cache": []}
    for i in range(repeats):  # interleaved pairs
        for arm, extra in (("live", []), ("cache", cached)):
            run_dir = work / "speed" / f"{arm}{i}"
            kdsweep([*common, *extra, f"hydra.run.dir={run_dir}"], work, ONE_THREAD)
            trials[arm].append(trial_numbers(run_dir))
    med = {arm: {k: statistics.median(t[k] for t in v) for k in v[0]} for arm, v in trials.items()}
    print(f"  step: live {med['live']['step_s']:.3f} s, cache {med['cache']['step_s']:.3f} s; start-up live "
          f"{med['live']['startup_s']:.1f} s, cache {med['cache']['startup_s']:.1f} s; peak memory live "
          f"{med['live']['peak_mem_mb']:.0f} MB, cache {med['cache']['peak_mem_mb']:.0f} MB", flush=True)

    sweeps = {}
    for arm, extra in (("live", []), ("cache", [*cached[:1], f"teacher.cache.dir={work / 'sweep_cache'}"])):
        sweep_dir = work / "sweeps" / arm
        wall = kdsweep(["-m", "hparams_search=kd_optuna", f"teacher.path={teacher}", "teacher.zoo=null",
                        "hydra.sweeper.n_trials=8", "hydra.sweeper.pruner=none", *extra,
                        f"hydra.sweep.dir={sweep_dir}"], work)
        manifest = json.loads((sweep_dir / "sweep.json").read_text())
        sweeps[arm] = {"wall_s": round(wall, 1), "cost": manifest["cost"],
                       "best_objective": min(t["values"][0] for t in manifest["trials"].values() if t.get("values"))}
        print(f"  8-trial sweep, {arm}: {wall:.1f} s", flush=True)
    return {"trials": trials, "median": med, "step_ratio": med["cache"]["step_s"] / med["live"]["step_s"],
            "startup_ratio": med["cache"]["startup_s"] / med["live"]["startup_s"],
            "peak_mem_ratio": med["cache"]["peak_mem_mb"] / med["live"]["peak_mem_mb"], "sweeps": sweeps,
            "sweep_wall_ratio": sweeps["cache"]["wall_s"] / sweeps["live"]["wall_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 12, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-flops-ratio", type=float, default=8.0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "teacher_cache.json"))
    parser.add_argument("--keep", default=None, help="keep the runs here (default: a temp dir)")
    args = parser.parse_args()

    from kdsweep.models import zoo
    from kdsweep.teacher.cache import Spec

    work = Path(args.keep or tempfile.mkdtemp(prefix="teacher_cache-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    vocab, seq_len = zoo.TOKENIZER["vocab_size"], 128
    student_flops = flops_per_token(zoo.ARCHS["tiny-student"], vocab, seq_len)
    teacher_flops = flops_per_token(TEACHER, vocab, seq_len)
    ratio = teacher_flops / student_flops
    if ratio < args.min_flops_ratio:
        raise SystemExit(f"the synthetic teacher has only {ratio:.1f}x the student's FLOPs per token")
    try:
        print("accuracy on the embedded default:", flush=True)
        acc = accuracy(work, args.ks)
        print(f"speed: a teacher with {ratio:.1f}x the student's FLOPs per token:", flush=True)
        spd = speed(work, big_teacher(work), args.repeats)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    at_128k = {}
    for method in ("full", "sample", "topk"):
        for k in ([0] if method == "full" else args.ks):
            spec = Spec(method=method, k=k, temperature=1.0, seed=0, vocab=128256, dtype="bfloat16")
            at_128k[method if method == "full" else f"{method}_k{k}"] = spec.bytes_per_position()

    print(f"\n{'arm':<11} {'objective':>9} {'vs live':>8} {'bytes/token':>11}")
    for name, arm in acc["arms"].items():
        disk = acc["bytes_on_disk"].get(name, {}).get("bytes_per_token")
        print(f"{name:<11} {arm['objective']:>9.4f} {100 * arm['relative_to_live']:>+7.2f}% "
              f"{'-' if disk is None else f'{disk:.0f}':>11}")
    print(f"step time: cache/live = {spd['step_ratio']:.3f} (live {spd['median']['live']['step_s']:.3f} s, "
          f"cache {spd['median']['cache']['step_s']:.3f} s; goal <= 0.5); start-up {spd['startup_ratio']:.2f}x, "
          f"peak memory {spd['peak_mem_ratio']:.2f}x")
    print(f"8-trial sweep wall: cache/live = {spd['sweep_wall_ratio']:.3f} (goal <= 0.6)")
    print("bytes per token at a 128,256 vocabulary (bf16 teacher): "
          + ", ".join(f"{k} {v}" for k, v in at_128k.items()))
    report = {
        "benchmark": "teacher_cache",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(), "cpus": len(os.sched_getaffinity(0)),
        "flops_per_token": {"student": student_flops, "teacher": teacher_flops, "ratio": ratio,
                            "teacher_arch": TEACHER, "seq_len": seq_len, "vocab": vocab},
        "accuracy": acc, "speed": spd, "bytes_per_token_at_128256_vocab_bf16": at_128k,
        "goals": {"sample_k12_within_1pct": abs(acc["arms"].get("sample_k12", {}).get("relative_to_live", 1)) <= 0.01,
                  "step_ratio_le_0_5": spd["step_ratio"] <= 0.5, "sweep_wall_ratio_le_0_6": spd["sweep_wall_ratio"] <= 0.6},
        "notes": ["speed: the synthetic teacher has random weights (speed does not depend on them); step times are the "
                  "median of each trial's steps after its third, then the median over interleaved repeats, at one "
                  "thread per process",
                  "sweeps: kd_optuna with pruning off, 2 trials at a time, one thread each; the cache arm's wall time "
                  "includes its teacher pass (the first trial builds the cache while the others wait)"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
