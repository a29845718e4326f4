"""Several teachers' targets (kdsweep.losses.mixture): the KD term is the weighted mean of the divergences to each
teacher, against a float64 reference written out here, for a teacher of the student's vocabulary beside one of
another tokenizer (aligned spans); no chunking changes it or its gradient; one teacher of any weight is that teacher."""

from __future__ import annotations

import pytest
import torch

from kdsweep.losses import DIVERGENCES, kd_loss_sums
from kdsweep.losses.cross_tokenizer import VocabMap
from kdsweep.losses.mixture import Mixture
from kdsweep.losses.targets import Logits
from test_span_losses import (B, IGNORE, PAIRS, T, VS, VT, cross_case, probs, rand, reads_of, ref_cross_sum,
                              ref_divergence, targets_of)


def both_teachers():
    ids, labels, t_ids, t_logits, spans = cross_case()
    cross = targets_of(spans, reads_of(ids, 6), labels, t_ids, t_logits, student_vocab=VS,
                            loss="gold", vocab_map=VocabMap.of(PAIRS, VS, VT)).targets
    same = rand(B, T, VS, seed=11)
    return ids, labels, t_ids, t_logits, spans, same, cross


def reference(ids, labels, t_ids, t_logits, spans, same, s_logits, weights) -> float:
    """w₀·Σ forward KL to the same-vocabulary teacher over trained positions + w₁·Σ GOLD over the aligned spans,
    the weights normalised."""
    w0, w1 = (w / sum(weights) for w in weights)
    flat_s, flat_same = s_logits.reshape(-1, VS), same.reshape(-1, VS)
    first = sum(ref_divergence("forward_kl", probs(flat_same[n].tolist()), probs(flat_s[n].tolist()))
                for n in range(B * T) if labels.reshape(-1)[n] != IGNORE)
    second = ref_cross_sum(ids, labels, t_ids, t_logits, spans, s_logits, "gold")
    return w0 * first + w1 * second


def test_the_mixture_is_the_weighted_mean_of_the_divergences_and_no_chunking_changes_it():
    ids, labels, t_ids, t_logits, spans, same, cross = both_teachers()
    s_logits = rand(B, T, VS, seed=12)
    weights = [3.0, 1.0]
    want = reference(ids, labels, t_ids, t_logits, spans, same, s_logits, weights)
    values, grads = [], []
    for chunks in (1, 2, 5, 50):  # the boundaries move past the second teacher's spans; the first has none
        mixture = Mixture([Logits(logits=same), cross], weights)
        s = s_logits.clone().requires_grad_()
        sums = kd_loss_sums(s, mixture, labels, ignore_index=IGNORE, num_chunks=chunks)
        sums.kd.backward()
        values.append(sums.kd.item())
        grads.append(s.grad)
        assert mixture.cuts(chunks) == cross.cuts(chunks)
    assert values[0] == pytest.approx(want, rel=1e-12)
    assert all(v == pytest.approx(values[0], rel=1e-12) for v in values)
    assert all(torch.allclose(g, grads[0], rtol=1e-12, atol=1e-14) for g in grads)
    # its gradient is the weighted mean of each teacher's alone
    alone = []
    for targets in (Logits(logits=same), cross):
        s = s_logits.clone().requires_grad_()
        kd_loss_sums(s, targets, labels, ignore_index=IGNORE, num_chunks=3).kd.backward()
        alone.append(s.grad)
    assert torch.allclose(grads[0], 0.75 * alone[0] + 0.25 * alone[1], rtol=1e-12, atol=1e-14)


def test_the_logged_distance_and_the_teachers_ce_are_weighted_means_too():
    ids, labels, t_ids, t_logits, spans, same, cross = both_teachers()
    s_logits = rand(B, T, VS, seed=13)
    kw = dict(divergence="jsd", beta=0.3, temperature=2.0, ignore_index=IGNORE, num_chunks=3)
    mixed = kd_loss_sums(s_logits, Mixture([Logits(logits=same), cross], [1.0, 1.0]), labels, **kw)
    each = [kd_loss_sums(s_logits, t, labels, **kw) for t in (Logits(logits=same), cross)]
    for name in ("kd", "kl", "ce", "tokens"):
        want = getattr(each[0], name) if name in ("ce", "tokens") else 0.5 * (getattr(each[0], name) + getattr(each[1], name))
        assert getattr(mixed, name).item() == pytest.approx(float(want), rel=1e-12), name
    y = labels.reshape(-1)
    tce = Mixture([Logits(logits=same), cross], [1.0, 1.0]).teacher_ce(y, VS, IGNORE)
    want = 0.5 * (Logits(logits=same).teacher_ce(y, VS, IGNORE) + cross.teacher_ce(y, VS, IGNORE))
    assert torch.allclose(tce, want, rtol=1e-12)


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_one_teacher_of_any_weight_is_that_teacher(divergence):
    _, labels, _, _, _, same, _ = both_teachers()
    s_logits = rand(B, T, VS, seed=14)
    kw = dict(divergence=divergence, beta=0.3, temperature=1.5, ignore_index=IGNORE, num_chunks=3)
    got = kd_loss_sums(s_logits, Mixture([Logits(logits=same)], [2.5]), labels, **kw)
    want = kd_loss_sums(s_logits, Logits(logits=same), labels, **kw)
    for a, b in zip(got, want):
        assert a.item() == pytest.approx(b.item(), rel=1e-12, abs=1e-14)
