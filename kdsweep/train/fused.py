"""``loss.impl=fused``: the KD loss from final hidden states, chunk by chunk, never holding B×T×V logits.

The student runs its own forward, so FSDP's hooks and peft's wrappers run as usual, but its output layer's forward
is swapped for the duration of the call (:mod:`kdsweep.models.heads`): it computes the whole loss instead of
logits: each chunk of tokens is projected by the layer's real forward (a Linear, a peft LoRA Linear, inside its FSDP
unit's unsharded context), scored by ``kd_loss_sums`` against the teacher's targets for the same chunk (a live
teacher's hidden states projected by its frozen output layer, or a cache's) and differentiated at once, so only one
chunk's logits exist at a time and backward has nothing to recompute. The student's output layer runs once per step
inside the root forward, which is where FSDP2 expects it (calling a sharded output layer again after the root forward
crashed in backward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kdsweep.losses import LossSums
from kdsweep.losses.targets import Targets
from kdsweep.models.heads import forward_replaced, output_layer, projection
from kdsweep.train.chunked import LossWithGradient, chunk_gradients


def fused_loss_sums(
    student: nn.Module,
    inputs: dict[str, torch.Tensor],
    targets: Targets,
    labels: torch.Tensor,
    *,
    kd_ratio: float,
    num_chunks: int,
    **loss_kwargs: Any,
) -> tuple[LossSums, torch.Tensor]:
    """The sums of ``kd_loss_sums`` (same arguments in ``loss_kwargs``, detached) over ``num_chunks`` token chunks,
    from the student's forward on ``inputs`` (as for :func:`~kdsweep.models.heads.final_hidden`) and the teacher's
    targets for the same tokens (a live teacher's final hidden states and projection, or a cache's); and the
    differentiable ``(1 - kd_ratio)·Σce + kd_ratio·Σkd`` (what ``LossSums.total`` gives) to call backward on."""
    layer = output_layer(student)
    student_head = projection(layer)
    y = labels.reshape(-1)

    def run(hidden: torch.Tensor, params: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        h_s = hidden.reshape(-1, hidden.shape[-1])
        stats = h_s.new_zeros(3, dtype=torch.float32)  # Σce, Σkd, Σkl
        grad_h, grad_p = [], [torch.zeros_like(p, dtype=torch.float32) for p in params]  # fp32 sums
        for sums, grads in chunk_gradients(h_s, targets, labels, num_chunks=num_chunks, kd_ratio=kd_ratio,
                                           project=student_head, wrt=params, **loss_kwargs):
            grad_h.append(grads[0])
            for acc, g in zip(grad_p, grads[1:]):
                if g is not None:
                    acc += g
            stats += sums
        mixed = (1.0 - kd_ratio) * stats[0] + kd_ratio * stats[1]
        return mixed, stats, torch.cat(grad_h).reshape(hidden.shape), [g.to(p.dtype) for g, p in zip(grad_p, params)]

    def loss_instead_of_logits(hidden: torch.Tensor) -> torch.Tensor:
        params = [p for p in layer.parameters() if p.requires_grad]  # FSDP: the unsharded ones, during forward
        mixed, stats = LossWithGradient.apply(hidden, run, *params)
        return torch.cat([mixed.reshape(1), stats])  # one tensor where the model returns its logits

    with forward_replaced(layer, loss_instead_of_logits):
        out = student(**inputs).logits
    mixed, (ce, kd, kl) = out[0], out[1:].unbind()
    return LossSums(ce=ce, kd=kd, kl=kl, tokens=(y != loss_kwargs.get("ignore_index", -100)).sum()), mixed
