"""Per-rank GPU memory of the 8B→1B preset (``+experiment=llama3_1_8b_to_3_2_1b``), computed from the models'
shapes: the README's table. Prints it and saves ``benchmarks/results/memory_plan.json``.

    python benchmarks/memory_plan.py

The preset: Llama-3.1-8B teacher, Llama-3.2-1B student (tied embeddings), vocabulary 128,256, ``data=chat``
(sequences of 2,048 tokens, micro-batches of 2), ``train.dtype=bf16``, LoRA rank 16 on all linear layers or a full
fine-tune, ``dist=fsdp2_gpu_bf16`` (activation checkpointing), 8 GPUs per node; the teacher replicated (what
``dist.teacher_placement=auto`` chooses on an 80 GB GPU for these sizes) or sharded per node. The model is stated in
``benchmarks/gpu/memory.py``; the GPU check (``benchmarks/gpu``) measures the peak of its own arms beside what the
same model predicts for them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "gpu")]

from memory import llama_params, per_rank  # noqa: E402  (benchmarks/gpu/memory.py)

LLAMA_31_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "tie_word_embeddings": False}
LLAMA_32_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
               "num_key_value_heads": 8, "tie_word_embeddings": True}
VOCAB, SEQ, MICRO = 128256, 2048, 2
TEACHER_BYTES = 2 * sum(v for k, v in llama_params(LLAMA_31_8B, VOCAB).items() if k != "per_layer")


def main() -> None:
    rows = []
    for name, lora in (("LoRA r16", 16), ("full fine-tune", 0)):
        for nodes in (1, 2):
            for placement in ("replicate", "node"):
                for loss in ("chunked", "fused"):
                    m = per_rank(LLAMA_31_8B, LLAMA_32_1B, VOCAB, lora_rank=lora, seq=SEQ, micro_batch=MICRO,
                                 ranks=8 * nodes, teacher_placement=placement, loss=loss)
                    shard = 1 if placement == "replicate" else 8  # node: the 8 GPUs of each node
                    gathered = TEACHER_BYTES * (shard - 1) / shard / 1e9
                    rows.append({"student": name, "gpus": f"{nodes}×8", "teacher": placement, "loss": loss, **m.row(),
                                 "teacher_all_gather_per_micro_batch": round(gathered, 2)})
    cols = ["student", "gpus", "teacher", "loss", "teacher_weights", "student_weights", "gradients", "optimizer",
            "activations", "loss_path", "total", "teacher_all_gather_per_micro_batch"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    out = HERE / "results" / "memory_plan.json"
    out.write_text(json.dumps({"units": "GB (1e9 bytes) per rank", "vocab": VOCAB, "seq": SEQ, "micro_batch": MICRO,
                               "rows": rows}, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
