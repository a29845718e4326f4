"""Which modules of the student get LoRA adapters: named presets that fit any architecture, or module names.

``model.target_modules`` lists presets and module names (a single string is a one-item list):

- ``all-linear``: every linear layer except the output layer, as peft defines it (``q_proj … down_proj`` on
  Llama, ``qkv_proj o_proj gate_up_proj down_proj`` on Phi-3, ``query_key_value dense dense_h_to_4h
  dense_4h_to_h`` on GPT-NeoX);
- ``attention`` / ``mlp``: the linear layers inside each decoder layer's attention / MLP block;
- any other item is a module name, matched as peft matches it (the whole dotted name or its last parts), e.g.
  ``lm_head`` or ``q_proj``.

They are resolved here, on the model itself, into the full names of the modules to adapt, so an item that
matches nothing is one line naming the modules the model has (peft would raise a traceback later), and the log
says exactly which modules LoRA reached.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from torch import nn

from kdsweep.config.schema import ConfigError
from kdsweep.distributed.fsdp import hf_model

PRESETS = ("all-linear", "attention", "mlp")
_BLOCKS = {"attention": ("attn", "attention"), "mlp": ("mlp", "feed_forward", "ffn")}


def _linear_types() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D  # GPT-2-style linear layers count as linear, as in peft

    return nn.Linear, Conv1D


def linear_modules(model: nn.Module) -> list[str]:
    """Full names of every linear layer of ``model``, in module order."""
    kinds = _linear_types()
    return [name for name, m in model.named_modules() if isinstance(m, kinds)]


def _output_layer_name(model: nn.Module) -> str | None:
    out = model.get_output_embeddings()
    return next((name for name, m in model.named_modules() if m is out), None)


def _block_linears(model: nn.Module, block: str) -> list[str]:
    """The linear layers inside the attention (or MLP) block of every decoder layer."""
    from kdsweep.distributed.fsdp import decoder_layers

    kinds, prefixes = _linear_types(), {id(m): n for n, m in model.named_modules()}
    names = []
    for layer in decoder_layers(model):
        for child_name, child in layer.named_children():
            if any(word in child_name.lower() for word in _BLOCKS[block]):
                base = f"{prefixes[id(child)]}."
                names += [base + n for n, m in child.named_modules() if isinstance(m, kinds)]
    return names


def _matches(name: str, item: str) -> bool:
    """peft's rule: the whole name, or its last dotted parts."""
    return name == item or name.endswith("." + item)


def resolve(model: nn.Module, requested: tuple[str, ...], key: str = "model.target_modules") -> list[str]:
    """Full names of the modules of ``model`` (a plain transformers model) that ``requested`` selects."""
    every = [name for name, _ in model.named_modules() if name]
    linear = linear_modules(model)
    chosen: list[str] = []
    for item in requested:
        if item == "all-linear":
            head = _output_layer_name(model)
            found = [n for n in linear if n != head]
        elif item in _BLOCKS:
            found = _block_linears(model, item)
        else:
            found = [n for n in every if _matches(n, item)]
        if not found:
            leaves = ", ".join(dict.fromkeys(n.rsplit(".", 1)[-1] for n in linear))
            what = f"has no {item} block" if item in _BLOCKS else f"has no module named {item}"
            raise ConfigError(
                f"{key}: {type(model).__name__} {what}; its linear layers are {leaves} (or use a preset: "
                f"{', '.join(PRESETS)})"
            )
        chosen += [n for n in found if n not in chosen]
    return chosen


def peft_targets(model: nn.Module, names: list[str]) -> list[str]:
    """The shortest names peft matches to exactly ``names``: a module's last name part where that part selects
    nothing else, its full name otherwise."""
    every = [n for n, _ in model.named_modules() if n]
    wanted, out = set(names), []
    for leaf in dict.fromkeys(n.rsplit(".", 1)[-1] for n in names):
        hits = {n for n in every if _matches(n, leaf)}
        out += [leaf] if hits <= wanted else sorted(hits & wanted)
    return out


def adapted(model: nn.Module) -> list[str]:
    """Full names (in the plain model) of the modules that carry a LoRA adapter."""
    from peft.tuners.lora import LoraLayer

    return [name for name, m in hf_model(model).named_modules() if isinstance(m, LoraLayer)]


def describe(names: list[str]) -> str:
    """``q_proj ×2, v_proj ×2, lm_head`` (module last names, with their counts)."""
    counts = Counter(n.rsplit(".", 1)[-1] for n in names)
    return ", ".join(f"{leaf} ×{c}" if c > 1 else leaf for leaf, c in counts.items())


def meta_model(model_dir: Path) -> nn.Module:
    """The model of ``model_dir`` built on the meta device: its structure, no memory, no weights read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def check_targets(model_dir: Path, requested: tuple[str, ...]) -> list[str]:
    """The modules ``requested`` selects in the model of ``model_dir`` (a ConfigError if an item selects none)."""
    return resolve(meta_model(model_dir), requested)
