"""What a teacher-logit cache keeps, as the loss sees it: sampled targets give the full forward-KL gradient on
average (RS-KD), top-k targets do not (they are biased) but are exact when the tail is empty and never above
the full divergence."""

import math

import pytest
import torch

from helpers import one_thread  # noqa: F401  (autouse: tiny tensors run fastest on one thread)
from kdsweep.losses import DIVERGENCES, kd_loss_sums, log_probs
from kdsweep.losses.targets import Logits, Samples, TopK
from kdsweep.teacher.build import row_targets
from kdsweep.teacher.cache import Spec

N, V = 5, 30


def logits(seed, scale=2.0):
    return torch.randn(N, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def targets(method, teacher, k, temperature=1.0, seed=0, labels=None):
    """The cache's targets of ``teacher`` logits, made by the builder's own function."""
    spec = Spec(method=method, k=k, temperature=temperature, seed=seed, vocab=V, dtype="float32")
    labels = torch.zeros(N, dtype=torch.long) if labels is None else labels
    gen = torch.Generator().manual_seed(seed)
    f = row_targets(teacher.float(), labels, spec, -100, gen)
    common = dict(ids=f["ids"].long(), label_logp=f["label_logp"].squeeze(-1), temperature=temperature, vocab=V)
    if method == "sample":
        return Samples(**common, entropy=f["entropy"].squeeze(-1))
    return TopK(**common, logp=f["logp"], tail_logp=f["tail_logp"].squeeze(-1))


def kd_grad(student, target, temperature=1.0, divergence="forward_kl"):
    s = student.clone().float().requires_grad_()
    sums = kd_loss_sums(s, target, torch.zeros(N, dtype=torch.long), divergence=divergence, temperature=temperature)
    sums.kd.backward()
    return sums.kd.detach().double(), s.grad.double()


@pytest.fixture(scope="module")
def draws():
    """The sample method's KD value and gradient for 3000 sampling seeds (k = 4 draws per position)."""
    teacher, student = logits(0), logits(1, scale=1.0)
    full_value, full_grad = kd_grad(student, teacher.float())
    values, grads = zip(*(kd_grad(student, targets("sample", teacher, k=4, seed=s)) for s in range(3000)))
    return teacher, student, full_value, full_grad, torch.stack(values), torch.stack(grads)


def standard_error(teacher, seeds, k=4):
    """The standard error of the mean of ``seeds`` sampled gradients: at T = 1 the gradient of token v is
    q_v − c_v/k with c_v ~ Binomial(k, p_v), whose variance is p_v(1 − p_v)/k (exact: no estimate from the draws,
    which never see a token the teacher gives 1e-4)."""
    p = torch.softmax(teacher, -1)
    return (p * (1 - p) / k / seeds).sqrt().clamp_min(1e-12)


def test_sampled_forward_kl_gradient_is_unbiased(draws):
    teacher, _, full_value, full_grad, values, grads = draws
    mean = grads.mean(0)
    z = (mean - full_grad).abs() / standard_error(teacher, len(grads))
    assert z.max() < 5.0, f"max |z| = {z.max():.2f}"  # 150 coordinates: |z| > 5 has chance ~1e-4 under the null
    assert (mean - full_grad).abs().max() < 0.05 * full_grad.abs().max()
    value_z = abs(values.mean() - full_value) / (values.std() / math.sqrt(len(values)))
    assert value_z < 5.0  # the KL value estimate (−H − mean log q of the draws) is unbiased too


def test_top_k_gradient_fails_the_same_test(draws):
    """A statistical test that could fail: the top-k gradient is off by many of the sampler's standard errors."""
    teacher, student, _, full_grad, _, grads = draws
    _, topk_grad = kd_grad(student, targets("topk", teacher, k=4))
    assert ((topk_grad - full_grad).abs() / standard_error(teacher, len(grads))).max() > 20


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_top_k_is_exact_when_the_tail_is_empty_and_a_lower_bound_otherwise(divergence):
    student = logits(3, scale=1.0)
    peaked = logits(4)
    peaked[:, 6:] = -1e4  # the teacher puts (numerically) all its mass on 6 tokens
    exact, _ = kd_grad(student, peaked.float(), divergence=divergence)
    coarse, _ = kd_grad(student, targets("topk", peaked, k=6), divergence=divergence)
    assert coarse.item() == pytest.approx(exact.item(), rel=1e-4, abs=1e-5)
    spread = logits(5)
    full, _ = kd_grad(student, spread.float(), divergence=divergence)
    lower, _ = kd_grad(student, targets("topk", spread, k=4), divergence=divergence)
    assert lower.item() <= full.item() + 1e-5  # coarse-graining never increases an f-divergence


def test_teacher_ce_and_temperature_semantics():
    teacher, student = logits(6), logits(7)
    labels = torch.arange(N) % V
    labels[1] = -100
    for method in ("sample", "topk"):
        t = targets(method, teacher, k=5, temperature=2.0, labels=labels)
        want = torch.nn.functional.cross_entropy(teacher.float(), labels, ignore_index=-100, reduction="none")
        assert torch.allclose(t.teacher_ce(labels, V, -100), want, atol=1e-5)  # exact: stored per position
        with pytest.raises(ValueError, match="cannot train at T=1.0"):  # taken at T=2: refused at another T
            t.divergence(log_probs(student.float(), 1.0), "forward_kl", 0.5, 1.0)
    with pytest.raises(ValueError, match="only forward_kl"):
        targets("sample", teacher, k=5).divergence(log_probs(student.float()), "reverse_kl", 0.5, 1.0)


def test_full_logits_give_the_dense_loss_exactly():
    teacher, student = logits(8), logits(9)
    labels = torch.arange(N) % V
    for divergence in DIVERGENCES:
        a = kd_loss_sums(student.float(), teacher.float(), labels, divergence=divergence, temperature=1.7)
        b = kd_loss_sums(student.float(), Logits(logits=teacher.float()), labels, divergence=divergence,
                         temperature=1.7, num_chunks=2)
        assert torch.allclose(torch.stack(list(a)).float(), torch.stack(list(b)).float(), rtol=1e-6, atol=1e-6)
