"""FSDP2 sharding of a Hugging Face causal LM (plain or peft-wrapped), and loading into the shards.

Units: every decoder layer (the model's ``_no_split_modules``), the output projection on its own when it is
not tied to the input embeddings (grouping it with the final norm crashed in backward with the HF forward),
and the root for what is left. Each rank then fills its own shards from the files (:mod:`kdsweep.models.shards`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from kdsweep.config.schema import DistConfig


def hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of the model: the classes transformers names in ``_no_split_modules``, else the items of
    its longest ``ModuleList`` (the decoder stack of any architecture that does not declare them)."""
    names = set(getattr(hf_model(model), "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        layers = list(max(stacks, key=len)) if stacks else []
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(hf_model(model)).__name__}")
    return layers


def shard(model: nn.Module, cfg: DistConfig, mesh: Any = None,
          mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Apply ``fully_shard`` per decoder layer, to an untied output projection, and at the root (in place), over
    ``mesh`` (None: every rank; a 2-D ``(replicate, shard)`` mesh: HSDP) with ``mp_policy``."""
    kw = {
        "mesh": mesh,
        "reshard_after_forward": cfg.reshard_after_forward,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        # pinned host memory needs an accelerator; on a CPU-only machine offloading is a plain copy
        "offload_policy": (CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cfg.cpu_offload
                           else OffloadPolicy()),
    }
    for layer in decoder_layers(model):
        fully_shard(layer, **kw)
    base = hf_model(model)
    out, inp = base.get_output_embeddings(), base.get_input_embeddings()
    if out is not None and out.weight is not inp.weight:
        fully_shard(out, **kw)
    fully_shard(model, **kw)
    return model


def gather_to_rank0(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict on CPU at rank 0 (``{}`` elsewhere). A collective: every rank calls it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
