"""``loss.impl=chunked``: the KD loss over the student's logits in token chunks, each chunk differentiated at once.

The student's forward writes its ``[N, V]`` logits; the loss then runs chunk by chunk, and each chunk's gradient with
respect to its own logits is taken before the next chunk's loss runs, so the fp32 temporaries of one chunk's loss
(log-probabilities, probabilities, the divergence's terms) are freed before the next chunk's exist. What lives across
the chunks is the logits and one ``[N, V]`` gradient of them; the step's one backward then runs the model's from it
(:class:`LossWithGradient`, which the fused loss shares).
A single backward over all chunks would keep every chunk's temporaries until the end: several ``[N, V]`` fp32 tensors.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch

from kdsweep.losses import LossSums, kd_loss_sums, token_chunks
from kdsweep.losses.targets import Targets


def chunk_gradients(x: torch.Tensor, targets: Targets, labels: torch.Tensor, *, num_chunks: int, kd_ratio: float,
                    project: Callable[[torch.Tensor], torch.Tensor] = lambda z: z, wrt: Sequence[torch.Tensor] = (),
                    divergence: str = "forward_kl", beta: float = 0.5, temperature: float = 1.0,
                    ignore_index: int = -100) -> Iterator[tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]]:
    """For each token chunk of ``x`` ``[N, ...]`` (the student's logits, or the hidden states ``project`` turns into
    them; the loss settings as for ``kd_loss_sums``): ``[Σce, Σkd, Σkl]`` of the chunk (detached) and the gradients of
    ``(1 - kd_ratio)·Σce + kd_ratio·Σkd`` with respect to the chunk of ``x`` and to ``wrt`` (None where unused), taken
    before the next chunk's loss runs."""
    for (x_c, y_c), t_c in token_chunks(targets, num_chunks, x, labels.reshape(-1)):
        with torch.enable_grad():
            leaf = x_c.detach().requires_grad_()
            # keywords spelled out: a **mapping would keep the projected logits alive through the whole call
            sums = kd_loss_sums(project(leaf), t_c, y_c, num_chunks=1, once=True, divergence=divergence, beta=beta,
                                temperature=temperature, ignore_index=ignore_index)
            grads = torch.autograd.grad(sums.total(kd_ratio), [leaf, *wrt], allow_unused=True)
        yield torch.stack([sums.ce, sums.kd, sums.kl]).detach(), grads


class LossWithGradient(torch.autograd.Function):
    """A loss computed *with* its gradient chunk by chunk (each chunk's temporaries live only inside it): forward
    runs ``run(x, params)`` → ``(mixed, stats, grad_x, grad_params)`` and keeps the gradients; backward only scales
    them by the upstream gradient (in place: one backward per forward). Nothing is recomputed, and what is kept for
    backward is one gradient of ``x`` and of ``params``, not any chunk's temporaries."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, run: Callable, *params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mixed, stats, grad_x, grad_params = run(x, params)
        ctx.save_for_backward(grad_x, *grad_params)
        ctx.mark_non_differentiable(stats)
        return mixed, stats

    @staticmethod
    def backward(ctx: Any, g_mixed: torch.Tensor, _g_stats: torch.Tensor) -> tuple[Any, ...]:
        grad_x, *grad_params = ctx.saved_tensors
        return (grad_x.mul_(g_mixed), None, *(g.mul_(g_mixed) for g in grad_params))


def chunked_loss_sums(logits: torch.Tensor, targets: Targets, labels: torch.Tensor, *, kd_ratio: float,
                      num_chunks: int, **loss_kwargs: Any) -> tuple[LossSums, torch.Tensor]:
    """The sums of ``kd_loss_sums`` (same ``loss_kwargs``, detached) over ``num_chunks`` token chunks of ``logits``
    ``[..., V]``, each chunk's gradient taken at once; and the differentiable ``(1 - kd_ratio)·Σce + kd_ratio·Σkd`` to
    call backward on (its backward writes the kept ``[N, V]`` gradient into the logits')."""

    def run(x: torch.Tensor, _params: tuple) -> tuple[torch.Tensor, ...]:
        flat = x.reshape(-1, x.shape[-1])
        grad = torch.empty_like(flat)
        stats = flat.new_zeros(3, dtype=torch.float32)  # Σce, Σkd, Σkl
        chunks = chunk_gradients(flat, targets, labels, num_chunks=num_chunks, kd_ratio=kd_ratio, **loss_kwargs)
        for (sums, (g,)), g_c in zip(chunks, torch.split(grad, targets.cuts(num_chunks), dim=0)):
            if g is None:  # a chunk left empty by a span it may not cut
                g_c.zero_()
            else:
                g_c.copy_(g)
            stats += sums
        mixed = (1.0 - kd_ratio) * stats[0] + kd_ratio * stats[1]
        return mixed, stats, grad.view(x.shape), []

    mixed, stats = LossWithGradient.apply(logits, run)
    ce, kd, kl = stats.unbind()
    return LossSums(ce=ce, kd=kd, kl=kl, tokens=(labels != loss_kwargs.get("ignore_index", -100)).sum()), mixed
