"""How many token chunks the loss of a micro-batch is split into: as many as its memory budget asks, no more.

The loss path's fp32 temporaries are ``[chunk, V]`` buffers (the student's logits or log-probabilities of a chunk,
their gradient, a teacher's rows of it, a divergence's terms), so their size, not a count, is what a chunk bounds:
``loss.chunk_mb`` caps one buffer and a micro-batch of N tokens takes ceil(N·V·4 B / chunk_mb) chunks. At a real
vocabulary that is many (2,048 tokens at 128k: 8 of 128 MiB); for a small model the whole loss is one chunk, and one
chunk runs the plain graph (:func:`kdsweep.train.step.micro_batch_backward`), which costs nothing for a split it does
not need. Growth: the count is linear in N and in V, each chunk's buffers fixed at ``chunk_mb``. On a CPU the plain
graph's loss is still computed in cache-sized pieces (:func:`pieces_for`), within its one graph and one backward.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kdsweep.config.schema import LossConfig
from kdsweep.distributed.fsdp import hf_model

FP32_BYTES = 4
PIECE_BYTES = 2**20
"""A CPU's piece of the plain graph's loss (:func:`pieces_for`)."""


def chunks_for(loss: LossConfig, tokens: int, vocab: int) -> int:
    """The token chunks of a micro-batch of ``tokens`` tokens over a vocabulary of ``vocab`` (``loss.impl=dense``:
    one, whatever its size)."""
    if loss.impl == "dense":
        return 1
    return max(1, math.ceil(tokens * vocab * FP32_BYTES / (loss.chunk_mb * 2**20)))


def pieces_for(device: torch.device, tokens: int, vocab: int) -> int:
    """How many pieces the plain graph (one chunk) computes its loss in: on a CPU, pieces whose ``[piece, V]`` fp32
    tensors hold at most :data:`PIECE_BYTES`, all in one graph with one backward, so the loss's elementwise passes
    (log-softmax and its backward, the divergence, the gathers' zero-filled gradients) run over tensors that stay in
    the CPU's caches and come from the allocator's free lists, not freshly faulted pages. In the steps of the embedded
    default and of a 512-token vocabulary (profiled on 2 cores), 1 MiB pieces beat 256 KiB–4 MiB ones and one piece:
    a single ``[1024, 512]`` log-softmax backward took 2.6× the time of the same rows in 8 pieces. On a GPU, one."""
    if device.type != "cpu":
        return 1
    return max(1, math.ceil(tokens * vocab * FP32_BYTES / PIECE_BYTES))


def output_rows(model: nn.Module) -> int:
    """The rows of ``model``'s output layer: its logits' width (a sharded layer's global shape)."""
    return int(hf_model(model).get_output_embeddings().weight.shape[0])


__all__ = ["FP32_BYTES", "PIECE_BYTES", "chunks_for", "output_rows", "pieces_for"]
