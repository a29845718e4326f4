"""How many token chunks the loss of a micro-batch is split into: as many as its memory budget asks, no more.

The loss path's fp32 temporaries are ``[chunk, V]`` buffers (the student's logits or log-probabilities of a chunk,
their gradient, a teacher's rows of it, a divergence's terms), so their size, not a count, is what a chunk bounds:
``loss.chunk_mb`` caps one buffer and a micro-batch of N tokens takes ceil(N·V·4 B / chunk_mb) chunks
(:meth:`~kdsweep.config.schema.LossConfig.chunks_for`: the arithmetic lives in the config, so that the teacher's side
decides by the same rule, :meth:`~kdsweep.config.schema.RunConfig.teacher_gives_hidden`; a run takes its counts from
the configured micro-batch, :meth:`~kdsweep.config.schema.RunConfig.loss_chunks`, the same on every rank). At a real
vocabulary that is many (2,048 tokens at 128k: 8 of 128 MiB); for a small model the whole loss is one chunk, and one
chunk runs the plain graph (:func:`kdsweep.train.step.micro_batch_backward`), which costs nothing for a split it does
not need. Growth: the count is linear in N and in V, each chunk's buffers fixed at ``chunk_mb``. On a CPU the plain
graph's loss is still computed in cache-sized pieces (:func:`pieces_for`), within its one graph and one backward.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kdsweep.distributed.fsdp import hf_model

FP32_BYTES = 4
PIECE_BYTES = 2**18
"""The least a CPU's piece of the plain graph's loss holds (:func:`pieces_for`): 256 KiB of ``[piece, V]`` fp32."""
MAX_PIECES = 4
"""The most pieces the plain graph's loss is cut into (:func:`pieces_for`)."""


def pieces_for(device: torch.device, tokens: int, vocab: int) -> int:
    """How many pieces the plain graph (one chunk) computes its loss in, all in its one graph with one backward: on a
    CPU as many as fill :data:`PIECE_BYTES` each, at most :data:`MAX_PIECES`, so that the loss's elementwise passes
    (log-softmax and its backward, the divergence, a gather's zero-filled gradient) run over tensors that stay in the
    CPU's caches and come from the allocator's free lists, while the pieces stay few enough for Python's overhead not
    to show; on a GPU, one. Measured (``benchmarks/loss_pieces.py``: the loss's forward and backward on 1,024 tokens,
    piece counts interleaved in each process, 2 cores): 4 pieces is the fastest at the 512 and the 2,052-token
    vocabularies of ``benchmarks/step_time.py``'s pairs; 1-3 cost 1.24-1.46x, 8 cost 1.40-1.61x (each piece's Python
    and autograd overhead)."""
    if device.type != "cpu":
        return 1
    return max(1, min(MAX_PIECES, math.ceil(tokens * vocab * FP32_BYTES / PIECE_BYTES)))


def output_rows(model: nn.Module) -> int:
    """The rows of ``model``'s output layer: its logits' width (a sharded layer's global shape)."""
    return int(hf_model(model).get_output_embeddings().weight.shape[0])


__all__ = ["FP32_BYTES", "MAX_PIECES", "PIECE_BYTES", "output_rows", "pieces_for"]
