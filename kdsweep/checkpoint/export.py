"""Final exports: the peft adapter and the merged HF model, in separate directories.

They are kept apart on purpose: a directory holding both merged weights and ``adapter_config.json`` makes
transformers apply the adapter a second time on load. A LoRA on an output layer tied to the input embeddings
(Qwen2.5-0.5B, Gemma) is merged into an untied copy, so the merged model is exactly the trained one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from torch import nn


def _publish(tmp: Path, final: Path) -> None:
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)


def _untie_adapted_output(base: nn.Module) -> None:
    """Give an output layer that carries LoRA its own copy of the weight it shares with the input embeddings.

    Merging adds the adapter's update to the output layer's weight; tied, that would change the input embeddings
    too and the merged model would not be the trained one. Untied, the merged model holds both matrices.
    """
    out, inp = base.get_output_embeddings(), base.get_input_embeddings()
    layer = getattr(out, "base_layer", None)  # a peft LoRA layer wraps the original Linear
    if layer is None or inp is None or layer.weight is not inp.weight:
        return
    layer.weight = nn.Parameter(inp.weight.detach().clone(), requires_grad=False)
    for config in {id(c): c for c in (base.config, base.config.get_text_config())}.values():
        config.tie_word_embeddings = False


def export(model: nn.Module, tokenizer, out: Path, *, adapter: bool, merged: bool) -> dict[str, str]:
    """Write ``out/adapter`` (LoRA runs) and ``out/merged``; returns the paths written.

    Merging folds the adapter into the base weights in place, so this must be the model's last use.
    """
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, str] = {}
    is_peft = hasattr(model, "peft_config")
    if adapter and is_peft:
        tmp = out / ".tmp-adapter"
        # The base stays frozen, so its embeddings never belong in the adapter (peft would add them when
        # lm_head is a LoRA target).
        model.save_pretrained(tmp, save_embedding_layers=False)
        _publish(tmp, out / "adapter")
        written["adapter"] = str(out / "adapter")
    if merged:
        if is_peft:
            _untie_adapted_output(model.get_base_model())
        full = model.merge_and_unload() if is_peft else model
        tmp = out / ".tmp-merged"
        full.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _publish(tmp, out / "merged")
        written["merged"] = str(out / "merged")
    return written
