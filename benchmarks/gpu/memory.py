"""Per-rank device memory of a KD job, computed from the models' shapes: weights, master weights, gradients, AdamW
state, activations and the loss path. The README's table for the 8B→1B preset comes from here
(``python benchmarks/memory_plan.py``), and the GPU check compares it with the peak it measures (``real_shapes``).

Counted per rank, with ``train.dtype=bf16`` (frozen weights in bf16; trainable ones, their gradients and AdamW's two
moments in fp32, FSDP2 shards of them when sharded; a full fine-tune's fp32 shards are its master weights, gathered
to bf16 one unit at a time):

- activations kept for backward, per token per student layer: ``34·h`` bytes (Korthikanti et al. 2022 with a fused
  attention kernel: no ``seq²`` scores); with activation checkpointing ``2·h`` (each layer's input) plus one layer's
  ``34·h`` while it is recomputed;
- the loss path, per micro-batch of ``N`` tokens over a vocabulary ``V``: ``chunked`` (today) holds the student's
  bf16 logits and, per chunk, fp32 log-probabilities of both models until the single backward, about ``10·N·V``
  bytes, plus a live teacher's bf16 logits ``2·N·V``; ``fused`` holds about 4 fp32 chunks, each at most
  ``loss.chunk_mb`` MiB (kdsweep.train.chunks): ``4·min(4·N·V, chunk_mb·2²⁰)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

GB = 1e9


def llama_params(shape: dict[str, Any], vocab: int) -> dict[str, int]:
    """Parameters of a Llama of ``shape``: per layer, embeddings, output layer (0 when tied), final norm."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return {"layers": n * layer, "embed": vocab * h, "head": 0 if shape.get("tie_word_embeddings") else vocab * h,
            "norm": h, "per_layer": layer}


def lora_params(shape: dict[str, Any], rank: int) -> int:
    """LoRA A and B on every linear layer of every decoder layer (``all-linear``)."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    pairs = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # q k v o gate up down
    return n * rank * sum(a + b for a, b in pairs)


@dataclass
class RankMemory:
    teacher_weights: float
    student_weights: float
    master_weights: float
    """fp32 copies beyond the weights themselves (none: the fp32 shards are the master weights; counted in weights)."""
    gradients: float
    optimizer: float
    activations: float
    loss_path: float

    @property
    def total(self) -> float:
        return sum(asdict(self).values())

    def row(self) -> dict[str, float]:
        return {**{k: round(v / GB, 2) for k, v in asdict(self).items()}, "total": round(self.total / GB, 2)}


def per_rank(teacher: dict[str, Any], student: dict[str, Any], vocab: int, *, lora_rank: int, seq: int,
             micro_batch: int, ranks: int = 1, ranks_per_node: int = 8, teacher_placement: str = "replicate",
             activation_checkpointing: bool = True, loss: str = "fused", chunk_mb: float = 128.0,
             live_teacher: bool = True,
             pure_bf16: bool = False) -> RankMemory:
    """One rank's memory for the student sharded over ``ranks`` (FSDP2) and the teacher placed as given."""
    t = llama_params(teacher, vocab)
    s = llama_params(student, vocab)
    t_bytes = 2 * (t["layers"] + t["embed"] + t["head"] + t["norm"]) if live_teacher else 0
    t_shard = {"replicate": 1, "node": min(ranks, ranks_per_node), "world": ranks}[teacher_placement]
    s_total = s["layers"] + s["embed"] + s["head"] + s["norm"]
    trainable = lora_params(student, lora_rank) if lora_rank else s_total
    master = 2 if pure_bf16 else 4
    if lora_rank:
        weights = (2 * s_total + master * trainable) / ranks
    else:
        weights = master * s_total / ranks + (2 * s["per_layer"] if ranks > 1 and not pure_bf16 else 0)  # a gathered unit
    h, n = student["hidden_size"], student["num_hidden_layers"]
    tokens = seq * micro_batch
    acts = tokens * n * 2 * h + tokens * 34 * h if activation_checkpointing else tokens * n * 34 * h
    if loss == "fused":
        loss_bytes = 4 * min(4 * tokens * vocab, chunk_mb * 2**20)
    else:
        loss_bytes = 10 * tokens * vocab + (2 * tokens * vocab if live_teacher else 0)
    return RankMemory(teacher_weights=t_bytes / t_shard, student_weights=weights, master_weights=0.0,
                      gradients=master * trainable / ranks, optimizer=2 * master * trainable / ranks,
                      activations=acts, loss_path=loss_bytes)
