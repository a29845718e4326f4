"""The output layer of a causal LM, as the fused loss and a live teacher use it: the final hidden states of a
forward, and the layer's own projection, called on any chunk of them.

Both models run their own forward, so FSDP's hooks and peft's wrappers run as usual, but the output layer's forward
can be swapped for the duration of a call (:func:`forward_replaced`): :func:`final_hidden` makes it return its
input. A frozen output layer is unsharded for as long as its projection is used (:func:`frozen_projection`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from kdsweep.distributed.fsdp import hf_model


def logit_transform(model: nn.Module) -> tuple[str, Any] | None:
    """(config field, value) of a transform the model applies to its logits after its output layer
    (:data:`~kdsweep.models.check.LOGIT_TRANSFORMS`: Gemma 2's soft-capping, ...), or None: its output layer's
    projection of its final hidden states is its logits."""
    from kdsweep.models.check import LOGIT_TRANSFORMS  # preflight refuses these first, from config.json

    config = getattr(hf_model(model), "config", None)
    for name in LOGIT_TRANSFORMS:
        if getattr(config, name, None) not in (None, 1, 1.0):
            return name, getattr(config, name)
    return None


def output_layer(model: nn.Module) -> nn.Module:
    """The model's output layer; refused when the model transforms its logits after it (the fused loss would
    score untransformed logits)."""
    from kdsweep.config.schema import ConfigError

    transform = logit_transform(model)
    if transform is not None:
        raise ConfigError(f"loss.impl=fused: {type(hf_model(model)).__name__} applies {transform[0]}="
                          f"{transform[1]} to its logits after the output layer; use loss.impl=chunked")
    return hf_model(model).get_output_embeddings()


def projection(layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's own forward, without module hooks (its parameters must be unsharded when it runs); a plain peft
    LoRA layer's as :func:`_lora_projection` computes it."""
    return _lora_projection(layer) or type(layer).forward.__get__(layer)


def _lora_projection(layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A peft LoRA ``Linear`` with one active plain adapter (no DoRA or other variant, no LoRA bias, not merged), as
    ``base(x) + scaling·B(A(dropout(x)))`` with the low-rank term added into the base layer's output in place: one
    ``[rows, V]`` tensor, where peft's own forward writes three at once (B's output, its scaled copy and the sum) —
    at an output layer that is two ``[chunk, V]`` buffers more at the fused loss's peak. None for any other layer."""
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:
        return None
    if not isinstance(layer, LoraLinear) or layer.disable_adapters or layer.merged or layer.fan_in_fan_out:
        return None
    adapters = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(adapters) != 1 or adapters[0] in layer.lora_variant or layer.lora_bias.get(adapters[0], False):
        return None
    name = adapters[0]
    base, lora_a, lora_b = layer.base_layer, layer.lora_A[name], layer.lora_B[name]
    dropout, scaling = layer.lora_dropout[name], layer.scaling[name]
    if type(base) is not nn.Linear:
        return None

    def project(x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(x, base.weight, base.bias)
        low = lora_a(dropout(x.to(lora_a.weight.dtype))) * scaling  # [rows, r]: small
        return out.addmm_(low.to(out.dtype), lora_b.weight.t().to(out.dtype))

    return project


@contextmanager
def forward_replaced(layer: nn.Module, fn: Callable[[torch.Tensor], Any]) -> Iterator[None]:
    layer.forward = fn  # an instance attribute: nn.Module.__call__ (and FSDP's hooks around it) run it
    try:
        yield
    finally:
        del layer.forward


def final_hidden(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[B, T, H]``: what the model's output layer receives (the decoder's last hidden state, after its norm)
    from the forward on ``inputs`` (``input_ids`` and, for packed or padded rows, position ids or a mask)."""
    with forward_replaced(output_layer(model), lambda hidden: hidden):
        return model(**inputs).logits


def frozen_hidden(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """:func:`final_hidden` of a frozen model whose projection :func:`frozen_projection` gives next: its output
    layer (FSDP: its own unit, gathered by the forward's hooks although the forward skips it) stays unsharded after
    the forward, for the projection to use and reshard, so it is gathered once per forward, not twice."""
    layer = output_layer(model)
    if hasattr(layer, "set_reshard_after_forward"):
        layer.set_reshard_after_forward(False, recurse=False)
    return final_hidden(model, inputs)


@contextmanager
def frozen_projection(model: nn.Module) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """The model's output projection, for no-grad use on any chunk until the context ends (FSDP: unsharded till then;
    already, after :func:`frozen_hidden`'s forward)."""
    layer = output_layer(model)
    # FSDP: the layer's own unit, or (an output layer tied to the embeddings) the root's
    owner = layer if hasattr(layer, "unshard") else model if hasattr(model, "unshard") else None
    if owner is not None:
        owner.unshard()
    try:
        yield projection(layer)
    finally:
        if owner is not None:
            owner.reshard()
