"""The memory model: what a rank holds besides the models' weights, from the models' shapes and the config (nothing
is read but their configs). One model for the two decisions that need it: a pack's plan (:mod:`kdsweep.pack.plan`:
how many trials fit a device) and the teachers' placement (:mod:`kdsweep.distributed.placement`: replicated or
sharded).

A training step, per micro-batch of ``N = micro_batch_size · seq_len`` tokens (Korthikanti et al. 2022, a fused
attention kernel: no ``seq²`` scores): activations kept for backward ``34·h`` bytes per token per student layer in
16 bits (twice that in fp32); with activation checkpointing each layer's input ``2·h`` plus one layer's ``34·h``;
the loss path over a vocabulary ``V``: ``fused`` about 4 fp32 chunks, each at most ``loss.chunk_mb`` MiB,
``chunked`` about ``10·N·V`` bytes, plus a live teacher's ``2·N·V`` logits. A teacher-cache build, per batch of
``N`` tokens: the teacher's forward, no gradient (one layer's temporaries at a time: at most one layer's ``34·h``),
and four ``[block, V]`` fp32 tensors of :data:`~kdsweep.losses.blocks.BLOCK_ELEMENTS` (a row's, if fewer; a
teacher that transforms its logits after its output layer: its ``[N, V]`` logits too). Growth: linear in N and in
the student's width and depth (activations), in V (the loss path, up to the chunk; the build's blocks not at all).
"""

from __future__ import annotations

from typing import Any

MIB = 2**20


def activation_bytes(tokens: int, layers: int, hidden: int, checkpointing: bool, bytes_per_value: int = 2) -> float:
    """Activations a student's step keeps for its backward (one micro-batch of ``tokens``)."""
    per_layer = 34 * hidden * bytes_per_value / 2
    return tokens * (layers * 2 * hidden + per_layer) if checkpointing else tokens * layers * per_layer


def loss_path_bytes(tokens: int, vocab: int, impl: str, chunk_mb: float, live_teacher: bool) -> float:
    """What the KD loss holds for one micro-batch of ``tokens`` over a vocabulary ``vocab``."""
    if impl == "fused":
        return 4 * min(4 * tokens * vocab, chunk_mb * MIB)
    return 10 * tokens * vocab + (2 * tokens * vocab if live_teacher else 0)


def value_bytes(dtype: str) -> int:
    """Bytes per activation value under ``train.dtype``."""
    return 4 if dtype == "fp32" else 2


def step_bytes(cfg: Any, student: Any, live_teacher: bool) -> float:
    """What one training step of the run ``cfg`` (a RunConfig) holds on a rank besides the weights and the optimizer:
    its micro-batch's activations and its loss path; ``student``: the student's transformers config."""
    tokens = cfg.data.micro_batch_size * cfg.data.seq_len
    return (activation_bytes(tokens, student.num_hidden_layers, student.hidden_size, cfg.dist.activation_checkpointing,
                             value_bytes(cfg.train.dtype))
            + loss_path_bytes(tokens, student.vocab_size, cfg.loss.impl, cfg.loss.chunk_mb, live_teacher))


def build_bytes(cfg: Any, teacher: Any, transforms_logits: bool) -> float:
    """What a teacher-cache build of the run ``cfg`` holds on a rank besides the teacher's weights: one layer's
    temporaries of its forward over a batch, its block of scored positions (``teacher``: its transformers config),
    and its whole logits when it transforms them after its output layer."""
    from kdsweep.losses.blocks import BLOCK_ELEMENTS

    tokens, vocab = cfg.data.micro_batch_size * cfg.data.seq_len, teacher.vocab_size
    width = value_bytes(cfg.train.dtype)
    block = min(BLOCK_ELEMENTS, cfg.data.seq_len * vocab)  # a block is at most a row's positions
    logits = tokens * vocab * width if transforms_logits else 0
    return activation_bytes(tokens, 1, teacher.hidden_size, False, width) + 4 * block * 4 + logits


__all__ = ["activation_bytes", "build_bytes", "loss_path_bytes", "step_bytes", "value_bytes"]
