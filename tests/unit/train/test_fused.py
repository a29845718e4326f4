"""loss.impl=fused: the same sums and gradients as the dense logits path, from hidden states chunk by chunk."""

import pytest
import torch

from helpers import tiny_llama
from kdsweep.losses import kd_loss_sums
from kdsweep.losses.targets import Logits
from kdsweep.models.heads import final_hidden, frozen_projection
from kdsweep.train.fused import fused_loss_sums

IGNORE = -100


def lora_student(seed: int):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(tiny_llama(vocab=96, hidden=32, seed=2),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"],
                                      init_lora_weights=False))  # B != 0, so A's gradient is not hidden
    return model


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd_normalized", "tvd"])
@pytest.mark.parametrize("lora", [True, False])
# Odd lengths, chunks of uneven size. One-token chunks project row by row, and fp32 matmuls over 1 row and over 39
# rows round differently (BLAS blocking): agreement there is 1e-5, elsewhere 1e-6.
@pytest.mark.parametrize("length,chunks,tol", [(17, 5, 1e-6), (9, 1, 1e-6), (13, 6, 1e-6), (13, 64, 1e-5)])
def test_fused_equals_dense_in_value_and_gradients(lora, length, chunks, tol, divergence):
    teacher = tiny_llama(vocab=100, hidden=48, seed=1).eval().requires_grad_(False)  # padded teacher vocab
    make = (lambda: lora_student(0)) if lora else (lambda: tiny_llama(vocab=96, hidden=32, seed=2))
    dense_model, fused_model = make(), make()
    fused_model.load_state_dict(dense_model.state_dict())
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(0, 96, (3, length), generator=g)
    labels = ids.clone()
    labels[0, :4] = IGNORE  # ragged masks: a masked prefix, a masked tail, a fully masked row
    labels[1, length // 2:] = IGNORE
    labels[2] = IGNORE
    kw = dict(temperature=1.5, ignore_index=IGNORE, divergence=divergence, beta=0.3)

    with torch.no_grad():
        t_logits = teacher(input_ids=ids).logits
        t_hidden = final_hidden(teacher, {"input_ids": ids})
    dense = kd_loss_sums(dense_model(input_ids=ids).logits, t_logits, labels, num_chunks=1, **kw)
    (dense.total(0.3) * 0.7).backward()
    with frozen_projection(teacher) as teacher_head:
        fused, mixed = fused_loss_sums(fused_model, {"input_ids": ids}, Logits(hidden=t_hidden, head=teacher_head),
                                       labels, kd_ratio=0.3, num_chunks=chunks, **kw)
        assert mixed.item() == pytest.approx(fused.total(0.3).item(), rel=1e-6)
        (mixed * 0.7).backward()  # backward scales the stored gradient by what flows in

    for name in ("ce", "kd", "kl"):
        assert getattr(fused, name).item() == pytest.approx(getattr(dense, name).item(), rel=tol, abs=tol), name
    assert fused.tokens.item() == dense.tokens.item()
    g_dense, g_fused = grads(dense_model), grads(fused_model)
    assert g_dense.keys() == g_fused.keys() and any("lm_head" in n for n in g_fused)  # the projection learns too
    for n in g_dense:
        scale = g_dense[n].abs().max().item()
        assert (g_fused[n] - g_dense[n]).abs().max().item() <= tol * max(scale, 1.0), n


def test_hidden_states_project_to_the_models_logits():
    model = tiny_llama(vocab=96, hidden=32, seed=4)
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad(), frozen_projection(model) as head:
        assert torch.allclose(head(final_hidden(model, {"input_ids": ids})), model(input_ids=ids).logits, atol=1e-6)
    assert model(input_ids=ids).logits.shape == (2, 7, 96)  # the output layer's own forward is back


def test_models_that_transform_their_logits_are_refused():
    from kdsweep.config import ConfigError
    from kdsweep.models.heads import output_layer

    model = tiny_llama(vocab=96, hidden=32, seed=5)
    model.config.final_logit_softcapping = 30.0  # as Gemma 2 does after its output layer
    with pytest.raises(ConfigError, match="final_logit_softcapping=30.0 .* use loss.impl=chunked"):
        output_layer(model)


@pytest.mark.parametrize("variant", ["lora", "dora", "merged"])
def test_a_lora_output_layer_projects_as_peft_computes_it(variant):
    """The fused loss's projection of a peft LoRA output layer adds the low-rank term into the base output in place
    (kdsweep.models.heads._lora_projection): peft's values and gradients; DoRA and a merged adapter take peft's own
    forward."""
    from peft import LoraConfig, get_peft_model

    from kdsweep.models.heads import _lora_projection, output_layer, projection

    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(vocab=96, hidden=32, seed=2),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"], init_lora_weights=False,
                                      use_dora=variant == "dora"))
    layer = output_layer(model)
    if variant == "merged":
        layer.merge()
    assert (_lora_projection(layer) is not None) == (variant == "lora")
    x = torch.randn(7, 32, requires_grad=True)
    got, want = projection(layer)(x), layer(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(want)
    params = [x, *(p for p in layer.parameters() if p.requires_grad)]
    grads = [torch.autograd.grad(out, params, g, allow_unused=True) for out in (got, want)]  # merged: A, B unused
    for a, b in zip(*grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
