"""Packed trials projected for the 8B→1B preset (``+experiment=llama3_1_8b_to_3_2_1b``, LoRA r16 on all linear
layers, bf16, sequences of 2,048, micro-batches of 2, activation checkpointing, the ``fused`` loss): one GPU's memory
for a pack of K (``kdsweep.pack.plan``'s terms over the Llama shapes of ``benchmarks/gpu/memory.py``), the largest K
on an 80 GB H100 and a 141 GB H200 at ``dist.memory_headroom=0.25``, and the sharing bound on device-seconds per
trial against an unpacked live trial. Prints the table and saves ``benchmarks/results/pack_plan.json``.

    python benchmarks/pack_plan.py [--out benchmarks/results/pack_plan.json]

The bound, (T/K + S)/(T + S), counts FLOPs per token: the teacher's forward T = 2·N_t; the student's LoRA step S =
its forward 2·N_s, its backward through the frozen base to the activations 2·N_s (no weight gradients for frozen
weights) and the adapters' weight gradients 2·N_lora, with N_lora counted again in the forward (both small). It
assumes both models run at the same utilisation and that a trial is all steps: a trial's start-up is its own (its
evaluations share the teacher as its steps do), so a measured pack may sit above or below this bound
(``benchmarks/pack.py``: 1.06x it at K=4 on the embedded default, 0.83x on the 512 pair, on this machine's CPUs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "gpu"), str(HERE)]

from memory import llama_params, lora_params  # noqa: E402  (benchmarks/gpu/memory.py)
from memory_plan import LLAMA_31_8B, LLAMA_32_1B, MICRO, SEQ, VOCAB  # noqa: E402

from kdsweep.pack.plan import PackPlan, activation_bytes, loss_path_bytes  # noqa: E402

KS = (1, 2, 4, 8, 16, 32)
GPUS = {"H100 80 GB": 80e9, "H200 141 GB": 141e9}
HEADROOM, RANK, CHUNK_MB = 0.25, 16, 128.0


def total(params: dict[str, int]) -> int:
    return params["layers"] + params["embed"] + params["head"] + params["norm"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=HERE / "results" / "pack_plan.json")
    args = parser.parse_args()
    n_t, n_s = total(llama_params(LLAMA_31_8B, VOCAB)), total(llama_params(LLAMA_32_1B, VOCAB))
    n_lora = lora_params(LLAMA_32_1B, RANK)
    tokens = SEQ * MICRO
    step = (activation_bytes(tokens, LLAMA_32_1B["num_hidden_layers"], LLAMA_32_1B["hidden_size"], True)
            + loss_path_bytes(tokens, VOCAB, "fused", CHUNK_MB, live_teacher=True))
    fixed = 2 * n_t + 2 * n_s + step  # bf16 teacher and student base
    per_member = 4 * 4 * n_lora  # fp32 adapter weights, gradients and AdamW's two moments
    t_flops, s_flops = 2 * n_t, 4 * n_s + 4 * n_lora
    rows = [{"K": k, "memory_gb": round((fixed + k * per_member) / 1e9, 2),
             "bound_per_trial": round((t_flops / k + s_flops) / (t_flops + s_flops), 3)} for k in KS]
    largest = {gpu: PackPlan(fixed, per_member, gb * (1 - HEADROOM), gpu).largest() for gpu, gb in GPUS.items()}
    print(f"8B->1B, LoRA r{RANK}: {fixed / 1e9:.1f} GB once (teacher {2 * n_t / 1e9:.1f}, student base "
          f"{2 * n_s / 1e9:.1f}, one member's step {step / 1e9:.2f}), {per_member / 1e9:.3f} GB per member; "
          f"teacher {t_flops / 1e9:.1f} GFLOP/token, student step {s_flops / 1e9:.1f}")
    print("K | memory GB | device-s per trial / unpacked (bound)")
    for r in rows:
        print(f"{r['K']} | {r['memory_gb']} | {r['bound_per_trial']}")
    print("largest K: " + ", ".join(f"{gpu}: {k}" for gpu, k in largest.items()))
    args.out.write_text(json.dumps({
        "preset": "llama3_1_8b_to_3_2_1b", "lora_rank": RANK, "seq": SEQ, "micro_batch": MICRO, "vocab": VOCAB,
        "headroom": HEADROOM, "fixed_gb": round(fixed / 1e9, 3), "per_member_gb": round(per_member / 1e9, 4),
        "teacher_gflop_per_token": round(t_flops / 1e9, 2), "student_gflop_per_token": round(s_flops / 1e9, 2),
        "rows": rows, "largest_k": largest}, indent=1))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
