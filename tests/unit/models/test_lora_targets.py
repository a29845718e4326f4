"""LoRA targets: presets resolved on each architecture's own module names, one line for a name that matches nothing."""

import pytest
import torch

from helpers import arch_config
from kdsweep.config import ConfigError, to_run_config
from kdsweep.distributed.fsdp import decoder_layers
from kdsweep.models import targets


def meta(arch):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(arch_config(arch, 32))


def leaves(names):
    return sorted({n.rsplit(".", 1)[-1] for n in names})


@pytest.mark.parametrize("arch,attention,mlp", [
    ("llama", ["k_proj", "o_proj", "q_proj", "v_proj"], ["down_proj", "gate_proj", "up_proj"]),
    ("phi3", ["o_proj", "qkv_proj"], ["down_proj", "gate_up_proj"]),
    ("gpt_neox", ["dense", "query_key_value"], ["dense_4h_to_h", "dense_h_to_4h"]),
    ("gemma3", ["k_proj", "o_proj", "q_proj", "v_proj"], ["down_proj", "gate_proj", "up_proj"]),
])
def test_presets_follow_each_family_s_names(arch, attention, mlp):
    model = meta(arch)
    assert leaves(targets.resolve(model, ("attention",))) == attention
    assert leaves(targets.resolve(model, ("mlp",))) == mlp
    every = targets.resolve(model, ("all-linear",))
    assert leaves(every) == sorted(attention + mlp) and len(every) == 2 * len(attention + mlp)  # 2 layers
    assert "lm_head" not in leaves(every)  # peft's all-linear leaves the output layer out
    assert targets.resolve(model, ("all-linear", "lm_head"))[-1] == "lm_head"


def test_peft_is_given_names_that_select_exactly_the_resolved_modules():
    model = meta("gpt_neox")
    names = targets.resolve(model, ("attention",))
    # "dense" alone is safe: peft matches dotted suffixes, so dense_4h_to_h is not a ".dense"
    assert targets.peft_targets(model, names) == ["query_key_value", "dense"]
    one_layer = [n for n in names if ".layers.0." in n]
    assert targets.peft_targets(model, one_layer) == one_layer  # a leaf name would reach layer 1 too


def test_a_name_that_matches_nothing_lists_the_model_s_layers():
    with pytest.raises(ConfigError) as e:
        targets.resolve(meta("phi3"), ("all-linear", "q_proj"))
    assert str(e.value) == ("model.target_modules: Phi3ForCausalLM has no module named q_proj; its linear layers are "
                            "o_proj, qkv_proj, gate_up_proj, down_proj, lm_head (or use a preset: all-linear, attention, mlp)")


def test_target_modules_takes_a_string_as_a_one_item_list():
    cfg = to_run_config({"output_dir": "/tmp/x", "model": {"zoo": "tiny-student", "target_modules": "all-linear"}})
    assert cfg.model.target_modules == ("all-linear",)


def test_decoder_layers_without_no_split_modules_are_the_longest_module_list():
    model = meta("olmo2")
    model._no_split_modules = None
    assert decoder_layers(model) == list(model.model.layers)
