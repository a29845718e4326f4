"""KD loss math against a dense float64 reference."""

import math
import weakref
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from kdsweep.losses import align_vocab, kd_loss_sums, split_chunks, token_chunks
from kdsweep.losses.targets import Logits
from helpers import one_thread  # noqa: F401  (autouse: tiny tensors run fastest on one thread)

IGNORE = -100


def reference(student, teacher, labels, temperature):
    """Dense float64 CE and T²·KL(teacher_T‖student_T) sums, written from the formulas."""
    s, t = student.double(), teacher.double()
    valid = labels != IGNORE
    log_p = torch.log_softmax(s, -1)
    ce = -(log_p.gather(-1, labels.clamp_min(0)[:, None])[:, 0] * valid).sum()
    log_ps, log_pt = torch.log_softmax(s / temperature, -1), torch.log_softmax(t / temperature, -1)
    kl = (log_pt.exp() * (log_pt - log_ps)).sum(-1)
    return ce, temperature**2 * (kl * valid).sum(), valid.sum()


def ragged(n, v, seed, masked=0.3):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, v, generator=g) * 3
    t = torch.randn(n, v, generator=g) * 3
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) < masked] = IGNORE
    return s, t, y


def test_kl_of_identical_distributions_is_zero():
    s, _, y = ragged(37, 50, 0)
    sums = kd_loss_sums(s, s.clone(), y, temperature=1.7, num_chunks=4)
    assert sums.kd.item() == pytest.approx(0.0, abs=1e-6)
    assert sums.ce.item() > 0


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0, 4.0])
@pytest.mark.parametrize("n", [1, 31, 64, 97])
def test_matches_dense_float64_reference(n, temperature):
    s, t, y = ragged(n, 40, n)
    got = kd_loss_sums(s, t, y, temperature=temperature, num_chunks=8)
    ce, kd, count = reference(s, t, y, temperature)
    assert got.tokens.item() == count.item()
    assert got.ce.item() == pytest.approx(ce.item(), rel=1e-5, abs=1e-5)
    assert got.kd.item() == pytest.approx(kd.item(), rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("n,chunks", [(97, 8), (33, 5), (10, 16), (128, 3)])
def test_chunked_equals_dense_in_value_and_gradient(n, chunks):
    s, t, y = ragged(n, 64, n + chunks)
    s1 = s.clone().requires_grad_()
    s2 = s.clone().requires_grad_()
    dense = kd_loss_sums(s1, t, y, temperature=2.0, num_chunks=1)
    chunked = kd_loss_sums(s2, t, y, temperature=2.0, num_chunks=chunks)
    dense.total(0.3).backward()
    chunked.total(0.3).backward()
    assert torch.allclose(dense.ce, chunked.ce, rtol=1e-6, atol=1e-6)
    assert torch.allclose(dense.kd, chunked.kd, rtol=1e-6, atol=1e-6)
    assert torch.allclose(s1.grad, s2.grad, rtol=1e-6, atol=1e-6)


def test_temperature_squared_scaling():
    """The KD term is T² times the KL between the tempered distributions (keeps gradient scale ~T-free)."""
    s, t, y = ragged(50, 30, 3, masked=0.0)
    for temperature in (1.0, 2.0, 3.0):
        got = kd_loss_sums(s, t, y, temperature=temperature).kd
        log_ps, log_pt = torch.log_softmax(s.double() / temperature, -1), torch.log_softmax(t.double() / temperature, -1)
        kl = (log_pt.exp() * (log_pt - log_ps)).sum()
        assert got.item() == pytest.approx(temperature**2 * kl.item(), rel=1e-5)


def test_all_masked_batch_gives_zero_not_nan():
    s, t, _ = ragged(20, 10, 4)
    s.requires_grad_()
    y = torch.full((20,), IGNORE)
    sums = kd_loss_sums(s, t, y, temperature=2.0, num_chunks=3)
    assert sums.tokens.item() == 0
    assert sums.ce.item() == 0.0 and sums.kd.item() == 0.0
    sums.total(0.5).backward()
    assert torch.isfinite(s.grad).all() and s.grad.abs().max().item() == 0.0


def test_ignored_tokens_do_not_matter():
    s, t, y = ragged(40, 12, 5, masked=0.5)
    s2, t2 = s.clone(), t.clone()
    masked = y == IGNORE
    s2[masked] += 100.0
    t2[masked] -= 50.0
    a, b = kd_loss_sums(s, t, y), kd_loss_sums(s2, t2, y)
    assert torch.allclose(a.ce, b.ce) and torch.allclose(a.kd, b.kd)


def test_padded_teacher_vocab_is_aligned():
    """A teacher whose output layer has extra (never used) rows gives the same loss once aligned."""
    s, t, y = ragged(25, 32, 6)
    padded = torch.cat([t, torch.randn(25, 8)], dim=-1)
    a = kd_loss_sums(s, t, y, temperature=2.0)
    b = kd_loss_sums(s, padded, y, temperature=2.0)
    assert torch.allclose(a.kd, b.kd) and torch.allclose(a.ce, b.ce)
    s_al, t_al = align_vocab(s, padded)
    assert s_al.shape == t_al.shape == (25, 32)


def test_split_chunks_keeps_tensors_aligned():
    x = torch.arange(11)
    pieces = split_chunks(4, x, x * 10, x[:, None].expand(11, 3))
    assert len(pieces) == 4
    for a, b, c in pieces:
        assert torch.equal(a * 10, b) and torch.equal(a, c[:, 0])
    assert torch.equal(torch.cat([p[0] for p in pieces]), x)
    with pytest.raises(ValueError):
        split_chunks(2, x, x[:5])


def test_token_chunks_hands_out_each_chunk_and_keeps_none_the_consumer_let_go():
    """A chunk of targets (and what it computes and keeps) must die when its consumer moves on, not live until the
    batch's last chunk is done (an evaluation kept a whole batch of teacher logits that way)."""
    x, y = torch.randn(10, 5), torch.arange(10)
    targets = Logits(logits=torch.randn(10, 5))
    seen, alive = [], []
    for (x_c, y_c), t_c in token_chunks(targets, 3, x, y):
        alive.append(sum(r() is not None for r in seen))
        seen.append(weakref.ref(t_c))
        assert torch.equal(t_c.logits, targets.logits[y_c]) and torch.equal(x_c, x[y_c])
    assert alive == [0, 0, 0] and len(t_c) == 3
    del t_c
    assert all(r() is None for r in seen)


def test_token_chunks_keeps_no_reference_to_the_chunk_its_consumer_works_on():
    """Once the consumer lets go of a chunk it was handed, the chunk dies then, not when the next is asked for: the
    fused loss's projected [chunk, V] logits were held by the generator through the chunk's whole loss and backward
    (one more [chunk, V] buffer at a real vocabulary)."""
    x, y = torch.randn(10, 5), torch.arange(10)
    for (x_c, y_c), t_c in token_chunks(Logits(logits=torch.randn(10, 5)), 3, x, y):
        refs = [weakref.ref(x_c), weakref.ref(y_c), weakref.ref(t_c)]
        del x_c, y_c, t_c
        assert [r() for r in refs] == [None, None, None]


@dataclass
class _Watched(Logits):
    """Logits whose divergence records whether the student's logits are still alive when it runs."""

    alive: list | None = None
    ref: Callable | None = None

    def split_at(self, sizes):
        return [_Watched(logits=c, alive=self.alive, ref=self.ref) for c in torch.split(self.logits, sizes)]

    def divergence(self, log_q, divergence, beta, temperature):
        self.alive.append(self.ref() is not None)
        return super().divergence(log_q, divergence, beta, temperature)


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_the_student_logits_die_before_the_divergence_runs(num_chunks):
    """kd_loss_sums lets its student's logits go once their log-probabilities exist (the step's graph keeps the
    log-probabilities, not the logits), so the divergence runs beside one [n, V] student tensor, not two."""
    w = torch.randn(4, 7, requires_grad=True)
    targets = _Watched(logits=torch.randn(12, 7), alive=[])

    def logits():  # the caller keeps no reference: a fused chunk's projection is handed straight in
        out = torch.randn(12, 4) @ w
        targets.ref = weakref.ref(out)
        return out

    sums = kd_loss_sums(logits(), targets, torch.arange(12) % 7, num_chunks=num_chunks, once=True)
    sums.total(0.5).backward()
    assert targets.alive == ([False] if num_chunks == 1 else [True, True, False])  # views keep their base alive
    assert w.grad is not None


def test_total_mixes_by_kd_ratio():
    s, t, y = ragged(16, 8, 7)
    sums = kd_loss_sums(s, t, y, temperature=1.0)
    assert math.isclose(sums.total(0.0).item(), sums.ce.item(), rel_tol=1e-6)
    assert math.isclose(sums.total(1.0).item(), sums.kd.item(), rel_tol=1e-6)
    assert math.isclose(sums.total(0.25).item(), 0.75 * sums.ce.item() + 0.25 * sums.kd.item(), rel_tol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_logged_kl_is_the_temperature_one_kl_and_carries_no_gradient(temperature):
    s, t, y = ragged(33, 17, 9)
    s.requires_grad_()
    sums = kd_loss_sums(s, t, y, temperature=temperature, num_chunks=4)
    _, kl_t1, _ = reference(s.detach(), t, y, 1.0)
    assert sums.kl.item() == pytest.approx(kl_t1.item(), rel=1e-5)
    assert not sums.kl.requires_grad


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd", "tvd"])
@pytest.mark.parametrize("rows_per_block", [1, 3])
def test_rows_scored_in_blocks_match_the_dense_reference_in_value_and_gradient(divergence, rows_per_block,
                                                                               monkeypatch):
    """The divergence runs a block of rows at a time, each block differentiated at once (kdsweep.losses.blocks),
    the teacher's rows projected per block from its hidden states; values and gradients are the dense ones."""
    import kdsweep.losses.blocks as blocks
    from kdsweep.losses import divergence_per_token
    from kdsweep.losses.targets import Logits

    n, v, h = 11, 13, 5
    s, _, y = ragged(n, v, 3)
    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(n, h, generator=g, dtype=torch.float64), torch.randn(v + 2, h, generator=g, dtype=torch.float64)
    s = s.double()
    projected = []
    head = lambda x: projected.append(len(x)) or x @ weight.T  # noqa: E731  (a padded teacher: v + 2 rows)
    monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", rows_per_block * (v + 2))
    leaf = s.clone().requires_grad_()
    sums = kd_loss_sums(leaf, Logits(hidden=hidden, head=head, rows=v + 2), y, divergence=divergence,
                        temperature=1.5, num_chunks=2)
    sums.kd.backward()
    assert projected and max(projected) == rows_per_block  # never more than one block's teacher rows
    ref = s.clone().requires_grad_()
    valid = y != IGNORE
    log_t = torch.log_softmax((hidden @ weight.T)[:, :v] / 1.5, -1)
    kd = (divergence_per_token(divergence, torch.log_softmax(ref / 1.5, -1), log_t) * valid).sum()
    kd = kd * (1.5 if divergence == "tvd" else 1.5**2)
    kd.backward()
    assert sums.kd.item() == pytest.approx(kd.item(), rel=1e-12)
    assert torch.allclose(leaf.grad, ref.grad, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd", "tvd"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("kd_ratio", [0.0, 0.4, 1.0])
def test_a_step_s_loss_differentiated_once_is_the_loss_autograd_differentiates(divergence, temperature, kd_ratio):
    """``once=True`` (a training step's graph, differentiated once): the student's log-softmax and CE write their
    gradient into the log-probabilities' own memory (kdsweep.losses.divergences._LogProbsOnce); values and gradients
    are autograd's through torch's log-softmax and nll_loss, CE alone (kd_ratio 0), KD alone (1) or both, and a
    second backward of that graph is refused, not silently wrong."""
    s, t, y = ragged(14, 11, 5)
    s = s.double()
    got, want = s.clone().requires_grad_(), s.clone().requires_grad_()
    kw = dict(divergence=divergence, beta=0.3, temperature=temperature, num_chunks=3)
    a = kd_loss_sums(got, t.double(), y, once=True, **kw)
    b = kd_loss_sums(want, t.double(), y, **kw)
    for x, z in zip(a, b):
        assert x.item() == pytest.approx(z.item(), rel=1e-12, abs=1e-12)
    a.total(kd_ratio).backward(retain_graph=True)
    b.total(kd_ratio).backward()
    assert torch.allclose(got.grad, want.grad, rtol=1e-10, atol=1e-12)
    assert want.grad.abs().sum() > 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        a.total(kd_ratio).backward()


def _graph_names(root) -> set[str]:
    seen, todo = set(), [root.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(f for f, _ in node.next_functions)
    return {type(n).__name__ for n in seen}


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("kd_ratio", [0.0, 0.4, 1.0])
def test_a_sampled_cache_s_draws_are_read_inside_the_log_softmax_and_give_autograd_s_gradient(temperature, kd_ratio):
    """A sampled cache's divergence reads only the student's log-probs at its draws (Samples.picks): in a step's
    graph (``once=True``) they are gathered inside the log-softmax's own function, whose backward scatters their
    gradient into the log-probs' memory, so no gather's zero-filled ``[n, V]`` gradient exists; values and
    gradients are those of autograd through torch's log-softmax, gather and nll_loss (ignored rows, 3 chunks)."""
    from kdsweep.losses.targets import Samples

    s, _, y = ragged(14, 11, 7)
    g = torch.Generator().manual_seed(8)
    t = Samples(ids=torch.randint(0, 11, (14, 5), generator=g), label_logp=torch.zeros(14), temperature=temperature,
                vocab=11, entropy=torch.rand(14, generator=g).double())
    got, want = s.double().requires_grad_(), s.double().clone().requires_grad_()
    kw = dict(temperature=temperature, num_chunks=3)
    a, b = kd_loss_sums(got, t, y, once=True, **kw), kd_loss_sums(want, t, y, **kw)
    for x, z in zip(a, b):
        assert x.item() == pytest.approx(z.item(), rel=1e-12, abs=1e-12)
    assert "GatherBackward0" not in _graph_names(a.total(kd_ratio)) and "GatherBackward0" in _graph_names(b.kd)
    a.total(kd_ratio).backward()
    b.total(kd_ratio).backward()
    assert torch.allclose(got.grad, want.grad, rtol=1e-10, atol=1e-12) and want.grad.abs().sum() > 0
