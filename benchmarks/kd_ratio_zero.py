"""A ``kd_ratio=0`` training step against a CE-only fine-tune's, at a real vocabulary (CPU).

Three arms, each repeat a process of its own (arms interleaved, one intra-op thread each):

- ``ce_only``: a plain fine-tune step: the student's forward, ``F.cross_entropy`` over its logits, backward,
  gradient clipping, AdamW.
- ``kd0_free``: ``train_step`` at ``kd_ratio=0`` with the training source a ``kd_ratio=0`` run has now
  (:class:`kdsweep.teacher.absent.TeacherFree`: no teacher forward, no targets).
- ``kd0_teacher``: the same ``train_step`` with the live teacher, as every ``kd_ratio=0`` run had before: the teacher's
  forward and its logits computed at every micro-batch, then weighted 0.

Student and teacher are tiny random-init Llamas (the student LoRA r8) with Llama-3.1's vocabulary size (128,256
rows; token ids drawn at random: the step's cost does not depend on the tokenizer), one micro-batch of
``--batch`` × ``--seq`` tokens, ``loss.impl=chunked``. The step time is the median over a process's steps after
the first, and the reported figure the median over its repeats.

    python benchmarks/kd_ratio_zero.py [--vocab 128256] [--batch 2] [--seq 512] [--steps 5] [--repeats 3]
                                       [--out benchmarks/results/kd_ratio_zero.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARMS = ("ce_only", "kd0_free", "kd0_teacher")


def one(arm: str, vocab: int, batch: int, seq: int, steps: int) -> dict:
    """The step times of ``arm`` in this process."""
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from kdsweep.config import LossConfig
    from kdsweep.data.batch import Batch
    from kdsweep.distributed import single_process
    from kdsweep.teacher.absent import TeacherFree
    from kdsweep.teacher.live import LiveTeacher
    from kdsweep.train.step import Learner, train_step

    torch.set_num_threads(1)

    def llama(seed: int, hidden: int) -> LlamaForCausalLM:
        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                            max_position_embeddings=seq, tie_word_embeddings=False, use_cache=False))

    student = get_peft_model(llama(0, 64), LoraConfig(r=8, target_modules=["q_proj", "v_proj"])).train()
    teacher = llama(1, 128).eval().requires_grad_(False)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    source = TeacherFree(vocab) if arm == "kd0_free" else LiveTeacher(teacher)
    loss_cfg = LossConfig(kd_ratio=0.0, impl="chunked")
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        y = torch.roll(x, -1, dims=1)
        t0 = time.perf_counter()
        if arm == "ce_only":
            logits = student(input_ids=x, use_cache=False).logits
            F.cross_entropy(logits.reshape(-1, vocab).float(), y.reshape(-1)).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            train_step([Learner(student, source, optimizer, scheduler, loss_cfg, max_grad_norm=1.0)], [Batch(x, y)],
                       dist=single_process())
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times[1:]), "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one measurement, in this process
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "kd_ratio_zero.json")
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(one(args.arm, args.vocab, args.batch, args.seq, args.steps)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    runs: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for r in range(args.repeats):
        for arm in ARMS:  # interleaved: a slow moment of the machine hits every arm alike
            out = subprocess.run([sys.executable, __file__, "--arm", arm, "--vocab", str(args.vocab), "--batch",
                                  str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)],
                                 env=env, capture_output=True, text=True, check=True)
            runs[arm].append(json.loads(out.stdout.strip().splitlines()[-1])["step_s"])
            print(f"repeat {r}: {arm:<12} {runs[arm][-1]:.3f} s/step", flush=True)
    median = {arm: statistics.median(v) for arm, v in runs.items()}
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
        "cpus": os.cpu_count(), "vocab": args.vocab, "tokens_per_step": args.batch * args.seq, "steps": args.steps,
        "repeats": args.repeats, "step_s": runs, "median_step_s": median,
        "kd0_free_over_ce_only": median["kd0_free"] / median["ce_only"],
        "kd0_teacher_over_ce_only": median["kd0_teacher"] / median["ce_only"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for arm in ARMS:
        print(f"{arm:<12} median {median[arm]:.3f} s/step  ({median[arm] / median['ce_only']:.2f}x ce_only)")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
