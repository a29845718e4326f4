"""Throughput and peak memory per rank of KD training with 1 and 2 ranks (FSDP2; gloo on CPU, nccl on GPUs).

Shapes: the embedded default (teacher 4×128, student 2×64) and a larger synthetic pair (random weights, the
embedded tokenizer) given by --synthetic. Each point is a whole `python -m kdsweep` process; tokens/s is the
median over the steps after the first two (warm-up), peak memory the last step's per-rank peak (process RSS
on CPU, max allocated on GPUs; run with MALLOC_MMAP_THRESHOLD_=262144 so glibc returns freed memory).

    MALLOC_MMAP_THRESHOLD_=262144 python benchmarks/ranks.py [--steps 12] [--ranks 1 2] [--device cpu] [--dtype fp32]
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
from pathlib import Path

SYNTHETIC = {
    "teacher": {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8},
    "student": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4},
}


def make_synthetic(root: Path) -> dict[str, str]:
    """Random-weight Llama teacher and student sharing the embedded tokenizer, saved as HF directories."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kdsweep.models import zoo

    tok = AutoTokenizer.from_pretrained(zoo.tokenizer_dir())
    dirs = {}
    for role, shape in SYNTHETIC.items():
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=1024, num_key_value_heads=shape["num_attention_heads"],
                          eos_token_id=tok.eos_token_id, tie_word_embeddings=False, **shape)
        d = root / role
        LlamaForCausalLM(cfg).save_pretrained(d)
        tok.save_pretrained(d)
        dirs[role] = str(d)
    return dirs


def run_point(name: str, overrides: list[str], ranks: int, steps: int, device: str, dtype: str, tmp: Path) -> dict:
    run_dir = tmp / f"{name}-{ranks}"
    cmd = [sys.executable, "-m", "kdsweep", *overrides, f"dist.nproc_per_node={ranks}", f"train.max_steps={steps}",
           f"train.eval_every={steps}", "checkpoint.save_every=0", "checkpoint.export_adapter=false",
           "checkpoint.export_merged=false", "logger=quiet", f"train.device={device}", f"train.dtype={dtype}",
           f"hydra.run.dir={run_dir}"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    warm = train[2:] or train
    return {
        "shape": name, "ranks": ranks, "device": device, "dtype": dtype, "steps": steps,
        "tokens_per_step": train[-1]["tokens"],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in warm),
        "tokens_per_s_per_rank": statistics.median(r["tokens_per_s_per_rank"] for r in warm),
        "peak_mem_mb_per_rank": train[-1]["peak_mem_mb_per_rank"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "ranks.json"))
    args = parser.parse_args()

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        synthetic = make_synthetic(tmp / "models")
        shapes = {
            "embedded": [],
            "synthetic": [f"model.path={synthetic['student']}", f"teacher.path={synthetic['teacher']}",
                          "data.seq_len=256", "data.batch_size=8", "data.micro_batch_size=4", "lr=1e-3"],
        }
        for name, overrides in shapes.items():
            for ranks in args.ranks:
                r = run_point(name, overrides, ranks, args.steps, args.device, args.dtype, tmp)
                results.append(r)
                mem = ", ".join(f"{m:.0f}" for m in r["peak_mem_mb_per_rank"])
                print(f"{name:<10} ranks={ranks} tokens/s={r['tokens_per_s']:>8.0f} per rank={r['tokens_per_s_per_rank']:>8.0f} "
                      f"peak MB per rank=[{mem}]", flush=True)
    report = {
        "benchmark": "ranks", "host": platform.node(), "cpus": len(os.sched_getaffinity(0)),
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"), "synthetic_shapes": SYNTHETIC,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
