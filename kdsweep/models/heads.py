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


def output_layer(model: nn.Module) -> nn.Module:
    """The model's output layer; refused when the model transforms its logits after it (the fused loss would
    score untransformed logits)."""
    from kdsweep.config.schema import ConfigError
    from kdsweep.models.check import LOGIT_TRANSFORMS  # preflight refuses these first, from config.json

    config = getattr(hf_model(model), "config", None)
    for name in LOGIT_TRANSFORMS:
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ConfigError(f"loss.impl=fused: {type(hf_model(model)).__name__} applies {name}="
                              f"{getattr(config, name)} to its logits after the output layer; use loss.impl=chunked")
    return hf_model(model).get_output_embeddings()


def projection(layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's own forward, without module hooks (its parameters must be unsharded when it runs)."""
    return type(layer).forward.__get__(layer)


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
