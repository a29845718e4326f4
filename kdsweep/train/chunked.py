"""``loss.impl=chunked`` (and ``dense``, one chunk): the KD loss over the student's logits, each chunk differentiated
at once.

The student's forward writes its ``[N, V]`` logits; the loss then runs chunk by chunk, and each chunk's gradient with
respect to its own logits is taken before the next chunk's loss runs, so the fp32 temporaries of one chunk's loss
(log-probabilities, probabilities, the divergence's terms) are freed before the next chunk's exist. What lives across
the chunks is the logits and one ``[N, V]`` gradient of them; one backward from the logits then runs the model's.
A single backward over all chunks would keep every chunk's temporaries until the end: several ``[N, V]`` fp32 tensors.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch

from kdsweep.losses import LossSums, kd_loss_sums, split_like
from kdsweep.losses.targets import Targets


def chunk_gradients(x: torch.Tensor, targets: Targets, labels: torch.Tensor, *, num_chunks: int, kd_ratio: float,
                    project: Callable[[torch.Tensor], torch.Tensor] = lambda z: z, wrt: Sequence[torch.Tensor] = (),
                    scale: torch.Tensor | float = 1.0,
                    **loss_kwargs: Any) -> Iterator[tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]]:
    """For each token chunk of ``x`` ``[N, ...]`` (the student's logits, or the hidden states ``project`` turns into
    them): ``[Σce, Σkd, Σkl]`` of the chunk (detached) and the gradients of ``scale·((1 - kd_ratio)·Σce +
    kd_ratio·Σkd)`` with respect to the chunk of ``x`` and to ``wrt`` (None where unused), taken before the next
    chunk's loss runs."""
    for (x_c, y_c), t_c in zip(split_like(targets, num_chunks, x, labels.reshape(-1)), targets.split(num_chunks)):
        with torch.enable_grad():
            leaf = x_c.detach().requires_grad_()
            sums = kd_loss_sums(project(leaf), t_c, y_c, num_chunks=1, **loss_kwargs)
            grads = torch.autograd.grad(sums.total(kd_ratio) * scale, [leaf, *wrt], allow_unused=True)
        yield torch.stack([sums.ce, sums.kd, sums.kl]).detach(), grads


def chunked_loss_backward(logits: torch.Tensor, targets: Targets, labels: torch.Tensor, *, kd_ratio: float,
                          scale: torch.Tensor, num_chunks: int, **loss_kwargs: Any) -> LossSums:
    """Backward of ``scale·((1 - kd_ratio)·Σce + kd_ratio·Σkd)`` (the sums of ``kd_loss_sums``, same ``loss_kwargs``)
    through ``logits`` ``[..., V]``, chunk by chunk; returns the sums, detached."""
    flat = logits.reshape(-1, logits.shape[-1])
    grad = torch.empty_like(flat)
    stats = flat.new_zeros(3, dtype=torch.float32)  # Σce, Σkd, Σkl
    chunks = chunk_gradients(flat, targets, labels, num_chunks=num_chunks, kd_ratio=kd_ratio, scale=scale, **loss_kwargs)
    for (sums, (g,)), g_c in zip(chunks, torch.split(grad, targets.cuts(num_chunks), dim=0)):
        if g is None:  # a chunk left empty by a span it may not cut
            g_c.zero_()
        else:
            g_c.copy_(g)
        stats += sums
    flat.backward(grad)
    ce, kd, kl = stats.unbind()
    return LossSums(ce=ce, kd=kd, kl=kl, tokens=(labels != loss_kwargs.get("ignore_index", -100)).sum())
