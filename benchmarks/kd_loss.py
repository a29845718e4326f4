"""Time and peak memory of the KD loss paths (dense, chunked, fused), forward + backward, on CPU.

Each measurement runs in its own process, so the peak is that process's own (``ru_maxrss``), with glibc's
allocator told to return large blocks (``MALLOC_MMAP_THRESHOLD_=262144``, else freed logits stay in its heap and
peaks are meaningless). The inputs are the output layer's: student hidden states ``[BT, H]`` (with gradient), a
trainable student projection ``H→V``, teacher hidden states and a frozen teacher projection, labels with 10%
ignored. ``peak_mb`` is the process peak; ``loss_mb`` subtracts the same process's peak before the loss ran
(weights, inputs, interpreter), i.e. what the loss itself needed.

    python benchmarks/kd_loss.py [--vocab 32000] [--hidden 512] [--bt 1024 2048 4096] [--dtype fp32] [--repeats 3]
                                 [--train-steps 6] [--out benchmarks/results/kd_loss.json]

Then it runs the embedded default (``python -m kdsweep``) with each ``loss.impl`` and reports the train step's
tokens/s from metrics.jsonl (mean over steps after the first).
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
IMPLS = ("dense", "chunked", "fused")
LOSS_ARMS = ("dense", "chunked", "chunked_one_backward", "fused")
"""The loss alone: each ``loss.impl`` as a train step runs it, and ``chunked_one_backward``: the chunks' losses summed
and differentiated in one backward (what ``chunked`` did before each chunk was differentiated at once)."""
CHUNK_TOKENS = 256  # fused and chunked: tokens per chunk


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(impl: str, vocab: int, hidden: int, bt: int, dtype: str, repeats: int) -> dict:
    """One configuration, in this process: returns time per forward+backward and peak memory."""
    import torch
    from types import SimpleNamespace

    from kdsweep.losses import kd_loss_sums
    from kdsweep.losses.targets import Logits
    from kdsweep.models.heads import frozen_projection
    from kdsweep.train.chunked import chunked_loss_sums
    from kdsweep.train.fused import fused_loss_sums

    torch.manual_seed(0)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    student_head = torch.nn.Linear(hidden, vocab, bias=False, dtype=dt)
    teacher_head = torch.nn.Linear(hidden, vocab, bias=False, dtype=dt).requires_grad_(False)
    h_s = torch.randn(bt, hidden, dtype=dt, requires_grad=True)
    h_t = torch.randn(bt, hidden, dtype=dt)
    labels = torch.randint(0, vocab, (bt,))
    labels[torch.rand(bt) < 0.1] = -100
    chunks = max(1, bt // CHUNK_TOKENS)
    kw = dict(temperature=1.0, ignore_index=-100)

    class Student(torch.nn.Module):
        """A causal LM whose decoder output is ``h_s``: what the loss paths see of a real one."""

        def __init__(self) -> None:
            super().__init__()
            self.lm_head = student_head

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.lm_head

        def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
            return SimpleNamespace(logits=self.lm_head(h_s))

    student, teacher = Student(), SimpleNamespace(get_output_embeddings=lambda: teacher_head)

    def step() -> float:
        if impl == "fused":
            with frozen_projection(teacher) as t_head:
                sums, mixed = fused_loss_sums(student, {"input_ids": labels}, Logits(hidden=h_t, head=t_head), labels, kd_ratio=0.5, num_chunks=chunks, **kw)
                loss = mixed / sums.tokens
                loss.backward()
        elif impl == "chunked_one_backward":
            with torch.no_grad():
                t_logits = teacher_head(h_t)
            sums = kd_loss_sums(student(labels).logits, t_logits, labels, num_chunks=chunks, **kw)
            loss = sums.total(0.5) / sums.tokens
            loss.backward()
        else:  # dense (one chunk) and chunked, as micro_batch_backward runs them
            with torch.no_grad():
                t_logits = teacher_head(h_t)
            tokens = (labels != -100).sum()
            sums, mixed = chunked_loss_sums(student(labels).logits, Logits(logits=t_logits), labels, kd_ratio=0.5,
                                            num_chunks=chunks if impl == "chunked" else 1, **kw)
            loss = mixed / tokens
            loss.backward()
        h_s.grad = None
        student_head.weight.grad = None
        return float(loss.detach())

    before = peak_mb()
    step()  # warm-up (and the peak)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"impl": impl, "vocab": vocab, "hidden": hidden, "bt": bt, "dtype": dtype, "time_s": statistics.median(times),
            "peak_mb": peak_mb(), "loss_mb": peak_mb() - before, "chunks": chunks if impl != "dense" else 1}


def in_subprocess(args: list[str]) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "262144"}
    out = subprocess.run([sys.executable, __file__, "--one", *args], capture_output=True, text=True, env=env, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def train_tokens_per_s(impl: str, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "kdsweep", f"loss.impl={impl}", f"train.max_steps={steps}",
                        f"train.eval_every={steps}", "checkpoint.save_every=0", "checkpoint.export_adapter=false",
                        "checkpoint.export_merged=false", "logger=quiet", f"hydra.run.dir={tmp}/run"],
                       check=True, capture_output=True, cwd=REPO)
        rows = [json.loads(line) for line in Path(tmp, "run", "metrics.jsonl").read_text().splitlines()]
    return statistics.mean(r["tokens_per_s"] for r in rows if r["kind"] == "train" and r["step"] > 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--bt", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train-steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "kd_loss.json")
    ap.add_argument("--one", nargs=6, metavar=("IMPL", "VOCAB", "HIDDEN", "BT", "DTYPE", "REPEATS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        impl, vocab, hidden, bt, dtype, repeats = args.one
        print(json.dumps(measure(impl, int(vocab), int(hidden), int(bt), dtype, int(repeats))))
        return

    import torch

    rows = [in_subprocess([impl, str(args.vocab), str(args.hidden), str(bt), args.dtype, str(args.repeats)])
            for bt in args.bt for impl in LOSS_ARMS]
    print(f"KD loss forward+backward, V={args.vocab}, H={args.hidden}, {args.dtype}, {CHUNK_TOKENS} tokens per chunk, "
          f"{torch.get_num_threads()} threads")
    print(f"{'BT':>6} {'impl':<20} {'time s':>8} {'x dense':>8} {'loss MB':>9} {'/ dense':>8} {'peak MB':>9}")
    for r in rows:
        dense = next(d for d in rows if d["bt"] == r["bt"] and d["impl"] == "dense")
        r["time_vs_dense"] = r["time_s"] / dense["time_s"]
        r["loss_mb_vs_dense"] = r["loss_mb"] / dense["loss_mb"]
        print(f"{r['bt']:>6} {r['impl']:<20} {r['time_s']:>8.3f} {r['time_vs_dense']:>8.2f} {r['loss_mb']:>9.0f} "
              f"{r['loss_mb_vs_dense']:>8.3f} {r['peak_mb']:>9.0f}")
    train = {impl: train_tokens_per_s(impl, args.train_steps) for impl in IMPLS}
    print("embedded default, whole KD train step: " + ", ".join(f"{k} {v:.0f} tokens/s" for k, v in train.items()))
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    payload = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "git_sha": sha, "host": platform.node(),
        "cpus": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "allocator": "MALLOC_MMAP_THRESHOLD_=262144", "chunk_tokens": CHUNK_TOKENS, "loss": rows,
        "train_step_tokens_per_s": train,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
