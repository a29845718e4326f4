"""A pack member's merged export merges a host copy of its student (kdsweep.pack.members.host_copy): the copy's
tensors are its own, equal to the member's and on the host; merging it leaves the base the members share as it was;
tied weights stay tied."""

import torch
from peft import LoraConfig, get_peft_model

from helpers import tiny_llama
from kdsweep.pack.members import host_copy, sharing_copy


def test_merging_a_host_copy_leaves_the_shared_base_untouched():
    base = tiny_llama(vocab=64, seed=1)
    base.config.tie_word_embeddings = True
    base.tie_weights()
    member = get_peft_model(sharing_copy(base), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                           init_lora_weights=False))
    before = {k: v.clone() for k, v in base.state_dict().items()}
    copy = host_copy(member)
    ours = {id(t) for t in member.parameters()}
    assert all(id(t) not in ours and t.device.type == "cpu" for t in copy.parameters())
    x = torch.randint(0, 64, (2, 7))
    torch.testing.assert_close(copy(input_ids=x).logits, member(input_ids=x).logits, atol=0, rtol=0)
    merged = copy.merge_and_unload()
    head, embed = merged.get_output_embeddings().weight, merged.get_input_embeddings().weight
    assert head is embed  # still tied
    assert all(torch.equal(v, before[k]) for k, v in base.state_dict().items())  # the shared base is unchanged
    torch.testing.assert_close(merged(input_ids=x).logits, member(input_ids=x).logits, atol=1e-5, rtol=0)
