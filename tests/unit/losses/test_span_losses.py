"""Cross-tokenizer KD terms (kdsweep.losses.cross_tokenizer) against an independent float64 reference written with
plain Python numbers: merged span distributions by the chain rule, ULD by sorted lists, GOLD's matched and
unmatched parts by explicit sums; the identity case (one vocabulary, one-token spans) is the same-tokenizer
divergence; gradients by finite differences (gradcheck)."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import one_thread  # noqa: F401  (autouse: tiny tensors run fastest on one thread)
from kdsweep.losses import DIVERGENCES, divergence_per_token, log_probs
from kdsweep.losses.cross_tokenizer import VocabMap, gold, log1mexp, merge, uld

VS, VT = 7, 9
PAIRS = [(0, 2), (1, 0), (3, 3), (4, 8)]  # (student id, teacher id): the strings both vocabularies hold


def rand(*shape, seed=0, scale=2.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def probs(row) -> list[float]:
    m = max(row)
    e = [math.exp(x - m) for x in row]
    return [x / sum(e) for x in e]


def ref_merged(rows, tokens) -> list[float]:
    """A span's merged distribution from its positions' logits ``rows`` and the span's later tokens: the first
    position's distribution times Π p_j(next token) over the later positions, and rest = 1 − that product."""
    first = probs(rows[0])
    c = 1.0
    for row, token in zip(rows[1:], tokens):
        c *= probs(row)[token]
    return [p * c for p in first] + [1.0 - c]


def ref_sorted_l1(p, q) -> float:
    a, b = sorted(p, reverse=True), sorted(q, reverse=True)
    n = max(len(a), len(b))
    a, b = a + [0.0] * (n - len(a)), b + [0.0] * (n - len(b))
    return sum(abs(x - y) for x, y in zip(a, b))


def ref_divergence(name, p, q, beta=0.5) -> float:
    """D(teacher p, student q) over the same outcomes, plain floats (0·log 0 = 0)."""
    def kl(a, b):
        return sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)
    if name == "forward_kl":
        return kl(p, q)
    if name == "reverse_kl":
        return kl(q, p)
    if name in ("jsd", "jsd_normalized"):
        m = [beta * x + (1 - beta) * y for x, y in zip(p, q)]
        value = beta * kl(p, m) + (1 - beta) * kl(q, m)
        return value / (beta * (1 - beta)) if name == "jsd_normalized" else value
    if name == "tvd":
        return 0.5 * sum(abs(x - y) for x, y in zip(p, q))
    return (1 - beta) * kl(p, q) + beta * kl(q, p)


def ref_gold(p, q, pairs, divergence, beta, w_m, w_u) -> float:
    """p: teacher merged [VT + 1], q: student merged [VS + 1] (the last entry: rest)."""
    s_shared, t_shared = [a for a, _ in pairs], [b for _, b in pairs]
    q_only = [q[i] for i in range(VS) if i not in s_shared] + [q[VS]]
    p_only = [p[i] for i in range(VT) if i not in t_shared] + [p[VT]]
    coarse_q = [q[a] for a in s_shared] + [sum(q_only)]
    coarse_p = [p[b] for b in t_shared] + [sum(p_only)]
    return w_m * ref_divergence(divergence, coarse_p, coarse_q, beta) + w_u * ref_sorted_l1(q_only, p_only)


def spans_case(seed):
    """Three spans: one student token to two teacher tokens, two student tokens to one teacher token, 1:1."""
    s_logits, t_logits = rand(5, VS, seed=seed), rand(5, VT, seed=seed + 100)
    s_tokens, t_tokens = [2, 5, 1, 0, 4], [1, 7, 3, 0, 2]  # the tokens each position's model is asked to predict
    s_spans, t_spans = [(0, 1), (1, 3), (3, 4)], [(0, 2), (2, 3), (3, 4)]
    return s_logits, t_logits, s_tokens, t_tokens, s_spans, t_spans


def merged_of(logits, tokens, spans, temperature=1.0):
    """The library's merge of each span: the first position's log-probs and the log-probability of the span's later
    tokens, read from the positions that predict them."""
    lp = log_probs(logits, temperature)
    heads = torch.stack([lp[a] for a, _ in spans])
    cont = torch.stack([sum((lp[k, tokens[k]] for k in range(a + 1, b)), lp.new_zeros(())) for a, b in spans])
    return merge(heads, cont)


@pytest.mark.parametrize("seed", [0, 1])
def test_merged_span_distributions_match_the_chain_rule(seed):
    s_logits, t_logits, s_tokens, t_tokens, s_spans, t_spans = spans_case(seed)
    for logits, tokens, spans in ((s_logits, s_tokens, s_spans), (t_logits, t_tokens, t_spans)):
        got = merged_of(logits, tokens, spans).exp()
        for row, (a, b) in zip(got, spans):
            expected = ref_merged(logits[a:b].tolist(), tokens[a + 1:b])
            assert row.tolist() == pytest.approx(expected, abs=1e-12)
            assert row.sum().item() == pytest.approx(1.0, abs=1e-12)
    assert log1mexp(torch.tensor([0.0])).item() == -math.inf
    x = torch.tensor([-1e-10, -0.5, -30.0], dtype=torch.float64)
    assert log1mexp(x).tolist() == pytest.approx([math.log(-math.expm1(v)) for v in x.tolist()], rel=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_uld_is_the_sorted_l1_of_the_merged_distributions(seed):
    s_logits, t_logits, s_tokens, t_tokens, s_spans, t_spans = spans_case(seed)
    got = uld(merged_of(s_logits, s_tokens, s_spans), merged_of(t_logits, t_tokens, t_spans))
    for value, (sa, sb), (ta, tb) in zip(got.tolist(), s_spans, t_spans):
        q = ref_merged(s_logits[sa:sb].tolist(), s_tokens[sa + 1:sb])
        p = ref_merged(t_logits[ta:tb].tolist(), t_tokens[ta + 1:tb])
        assert value == pytest.approx(ref_sorted_l1(q, p), abs=1e-12)


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("weights", [(None, None), (0.7, 0.2)])
def test_gold_matches_the_reference(divergence, weights):
    s_logits, t_logits, s_tokens, t_tokens, s_spans, t_spans = spans_case(3)
    vocab = VocabMap.of(PAIRS, VS, VT)
    w_m, w_u = weights
    got = gold(merged_of(s_logits, s_tokens, s_spans), merged_of(t_logits, t_tokens, t_spans), vocab, divergence,
               beta=0.3, w_matched=w_m, w_unmatched=w_u)
    w_m, w_u = (len(PAIRS) / VT, 1 - len(PAIRS) / VT) if w_m is None else (w_m, w_u)
    for value, (sa, sb), (ta, tb) in zip(got.tolist(), s_spans, t_spans):
        q = ref_merged(s_logits[sa:sb].tolist(), s_tokens[sa + 1:sb])
        p = ref_merged(t_logits[ta:tb].tolist(), t_tokens[ta + 1:tb])
        assert value == pytest.approx(ref_gold(p, q, PAIRS, divergence, 0.3, w_m, w_u), abs=1e-10, rel=1e-10)


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_vocabulary_and_one_token_spans_give_the_same_tokenizer_divergence(divergence, dtype):
    s_logits, t_logits = rand(6, VS, seed=5).to(dtype), rand(6, VS, seed=6).to(dtype)
    log_q, log_p = log_probs(s_logits, 2.0), log_probs(t_logits, 2.0)
    zero = torch.zeros(6, dtype=dtype)
    identity = VocabMap.of([(i, i) for i in range(VS)], VS, VS)
    got = gold(merge(log_q, zero), merge(log_p, zero), identity, divergence, beta=0.4)
    expected = divergence_per_token(divergence, log_q, log_p, beta=0.4)
    assert torch.allclose(got.to(torch.float64), expected.to(torch.float64), rtol=1e-6, atol=1e-7)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("loss", ["gold", "uld"])
def test_gradients_match_finite_differences(loss):
    _, t_logits, s_tokens, t_tokens, s_spans, t_spans = spans_case(7)
    teacher = merged_of(t_logits, t_tokens, t_spans, temperature=1.5)
    vocab = VocabMap.of(PAIRS, VS, VT)

    def kd(student_logits):
        student = merged_of(student_logits, s_tokens, s_spans, temperature=1.5)
        if loss == "uld":
            return uld(student, teacher).sum()
        return gold(student, teacher, vocab, "jsd", beta=0.5).sum()

    assert torch.autograd.gradcheck(kd, (rand(5, VS, seed=8).requires_grad_(),), eps=1e-6, atol=1e-6)


# -- the targets on the student's positions (kdsweep.losses.aligned, built by kdsweep.teacher.cross) ---------------

from kdsweep.losses import kd_loss_sums  # noqa: E402
from kdsweep.losses.targets import Logits  # noqa: E402
from kdsweep.teacher.align import Span  # noqa: E402
from kdsweep.teacher.aligned_rows import BatchPlan, RowPlan, span_plan  # noqa: E402
from kdsweep.teacher.cross import aligned_targets, rows_of  # noqa: E402
from kdsweep.teacher.reader import Read  # noqa: E402

B, T, IGNORE = 2, 7, -100


def reads_of(ids, teacher_len=T):
    """Rows whose targets are their next inputs (token j is predicted by position j − 1), and one document each
    on the teacher's side (positions 0, 1, …)."""
    return [Read("", [], [], [], list(range(teacher_len)), student_ids=row, predictor=[None, *range(len(row) - 1)])
            for row in ids.tolist()]


def targets_of(spans, reads, labels, t_ids, t_logits, **kw):
    """The targets of rows whose spans are ``spans``, read by ``reads``, with the teacher's tokens ``t_ids`` [B, W]
    and logits ``t_logits`` [B, W, Vt]: each row's plan, as kept with the rows, then the batch's."""
    plans = []
    for row, read, trained, ids in zip(spans, reads, (labels != IGNORE).tolist(), t_ids):
        kept, dropped = span_plan(row, read, trained)
        plans.append(RowPlan(torch.tensor(kept, dtype=torch.int32).reshape(-1, 4), ids.int(),
                             torch.tensor(read.teacher_positions, dtype=torch.int32), dropped))
    plan = BatchPlan.of(plans, labels.shape[1], pad_id=0)
    return aligned_targets(plan, labels, plan.teacher_ids, rows_of(t_logits), **kw)


def rows(seed, vocab):
    ids = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), IGNORE)], dim=1)
    labels[0, 1] = IGNORE  # a prompt token: not trained
    return ids, labels


def test_one_tokenizer_through_the_cross_tokenizer_path_gives_the_same_tokenizer_loss():
    ids, labels = rows(0, VS)
    s_logits, t_logits = rand(B, T, VS, seed=1), rand(B, T, VS, seed=2)
    spans = [[Span((a, a + 1), (a, a + 1), (a, a + 1)) for a in range(T)] for _ in range(B)]
    identity = VocabMap.of([(i, i) for i in range(VS)], VS, VS)
    for divergence in DIVERGENCES:
        built = targets_of(spans, reads_of(ids), labels, ids, t_logits, student_vocab=VS, loss="gold",
                                vocab_map=identity, kl_divergence="forward_kl")
        assert built.dropped == 0 and built.spans == int((labels != IGNORE).sum())
        for chunks in (1, 3):
            kw = dict(divergence=divergence, beta=0.3, temperature=1.5, ignore_index=IGNORE, num_chunks=chunks)
            got = kd_loss_sums(s_logits, built.targets, labels, **kw)
            want = kd_loss_sums(s_logits, Logits(logits=t_logits), labels, **kw)
            for a, b in zip(got, want):
                assert a.item() == pytest.approx(b.item(), rel=1e-9, abs=1e-12), divergence
    valid = (labels != IGNORE).reshape(-1)
    tce = built.targets.teacher_ce(labels.reshape(-1), VS, IGNORE)
    want = Logits(logits=t_logits).teacher_ce(labels.reshape(-1), VS, IGNORE)
    assert torch.allclose(tce[valid], want[valid]) and (tce[~valid] == 0).all()


def cross_case():
    """Row 0: student tokens 0 | 1 2 | 3 | 4 5 6 against teacher tokens 0 | 1 | 2 3 | 4 5 (spans 1:1, 2:1, 1:2, 3:2);
    row 1: one span cut by the untrained position 1 (dropped), the others 1:1."""
    ids, labels = rows(3, VS)
    labels[0, 1], labels[1, 1] = ids[0, 2], IGNORE  # row 0 fully trained; row 1's position 1 not
    t_ids = torch.randint(0, VT, (B, 6), generator=torch.Generator().manual_seed(4))
    spans = [[Span((0, 1), (0, 1), (0, 1)), Span((1, 3), (1, 2), (1, 3)), Span((3, 4), (2, 4), (3, 4)),
              Span((4, 7), (4, 6), (4, 7))],
             [Span((0, 1), (0, 1), (0, 1)), Span((1, 3), (1, 3), (1, 3)), Span((3, 4), (3, 4), (3, 4)),
              Span((4, 5), (4, 5), (4, 5)), Span((5, 6), (5, 6), (5, 6))]]
    return ids, labels, t_ids, rand(B, 6, VT, seed=5), spans


def ref_cross_sum(ids, labels, t_ids, t_logits, spans, s_logits, loss, weights=None) -> float:
    """Σ over the spans of :func:`cross_case` that train of their GOLD (forward KL; ``weights``: (matched,
    unmatched), GOLD's when None) or ULD term."""
    w_m, w_u = weights or (len(PAIRS) / VT, 1 - len(PAIRS) / VT)
    flat_s, flat_t = s_logits.reshape(-1, VS), t_logits.reshape(-1, VT)
    total = 0.0
    for b, row in enumerate(spans):
        for span in row:
            (a, e), (c, d) = span.student, span.teacher
            if a == 0 or not all(labels[b, a - 1:e - 1] != IGNORE):
                continue
            q = ref_merged(flat_s[b * T + a - 1:b * T + e - 1].tolist(), ids[b, a + 1:e].tolist())
            p = ref_merged(flat_t[b * 6 + c - 1:b * 6 + d - 1].tolist(), t_ids[b, c + 1:d].tolist())
            total += ref_sorted_l1(q, p) if loss == "uld" else ref_gold(p, q, PAIRS, "forward_kl", 0.5, w_m, w_u)
    return total


@pytest.mark.parametrize("loss", ["gold", "uld"])
def test_span_targets_match_the_reference_and_no_chunking_changes_them(loss):
    ids, labels, t_ids, t_logits, spans = cross_case()
    built = targets_of(spans, reads_of(ids, 6), labels, t_ids, t_logits, student_vocab=VS, loss=loss,
                            vocab_map=VocabMap.of(PAIRS, VS, VT))
    assert built.spans == 6 and built.dropped == 1  # row 1's span over the untrained position 1
    s_logits = rand(B, T, VS, seed=6)
    expected = ref_cross_sum(ids, labels, t_ids, t_logits, spans, s_logits, loss)
    values, grads = [], []
    for chunks in (1, 2, 5, 50):  # boundaries move past spans; a chunk may be empty
        s = s_logits.clone().requires_grad_()
        sums = kd_loss_sums(s, built.targets, labels, ignore_index=IGNORE, num_chunks=chunks)
        sums.kd.backward()
        values.append(sums.kd.item())
        grads.append(s.grad)
        cuts = built.targets.cuts(chunks)
        assert sum(cuts) == B * T and all(not (h < sum(cuts[:i]) <= last) for h, last in built.targets.extent
                                          for i in range(len(cuts)))
    assert values[0] == pytest.approx(expected, rel=1e-12)
    assert all(v == pytest.approx(values[0], rel=1e-12) for v in values)
    assert all(torch.allclose(g, grads[0], rtol=1e-12, atol=1e-14) for g in grads)


def test_log1mexp_has_a_finite_gradient_where_a_continuation_is_certain():
    x = torch.tensor([0.0, -1e-3, -5.0], dtype=torch.float64, requires_grad=True)
    y = log1mexp(x)
    y[1:].sum().backward()  # a span whose continuation has probability 1 (x = 0) sits beside others
    assert y[0].item() == -math.inf and torch.isfinite(x.grad).all() and x.grad[0] == 0


def test_at_a_temperature_the_uld_parts_carry_t_and_the_matched_part_t_squared():
    """ULD is an L1 distance like TVD: the loss scales it by T, the chosen divergence (forward KL) by T²."""
    ids, labels, t_ids, t_logits, spans = cross_case()
    s_logits, temperature = rand(B, T, VS, seed=9), 2.0
    at_t = lambda *w: ref_cross_sum(ids, labels, t_ids, t_logits / temperature, spans, s_logits / temperature, *w)
    w_m = len(PAIRS) / VT
    want = {"uld": temperature * at_t("uld"),
            "gold": temperature ** 2 * at_t("gold", (w_m, 0.0)) + temperature * at_t("gold", (0.0, 1 - w_m))}
    for loss, expected in want.items():
        built = targets_of(spans, reads_of(ids, 6), labels, t_ids, t_logits, student_vocab=VS,
                                loss=loss, vocab_map=VocabMap.of(PAIRS, VS, VT))
        sums = kd_loss_sums(s_logits, built.targets, labels, ignore_index=IGNORE, temperature=temperature, num_chunks=2)
        assert sums.kd.item() == pytest.approx(expected, rel=1e-12), loss


def test_chunk_boundaries_move_to_the_first_place_no_span_crosses():
    """kdsweep.losses.targets.cuts_avoiding against its definition, walked place by place: random spans (some side
    by side, some long, one to the last position), any number of chunks."""
    from kdsweep.losses.targets import chunk_sizes, cuts_avoiding

    def walked(n, num_chunks, extents):
        inside = [False] * (n + 1)
        for first, last in extents:
            for p in range(first + 1, last + 1):
                inside[p] = True
        bounds, previous, at = [], 0, 0
        for size in chunk_sizes(n, num_chunks):
            at += size
            b = max(at, previous)
            while b < n and inside[b]:
                b += 1
            bounds.append(b)
            previous = b
        return [b - a for a, b in zip([0, *bounds[:-1]], bounds)]

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        n = int(torch.randint(1, 60, (), generator=g))
        heads = sorted(set(torch.randint(0, n, (int(torch.randint(0, n + 1, (), generator=g)),), generator=g).tolist()))
        extents, end = [], -1
        for h in heads:
            if h > end:
                end = min(n - 1, h + int(torch.randint(0, 6 if trial % 3 else 30, (), generator=g)))
                extents.append((h, end))
        for chunks in (1, 2, 3, 7, 64):
            got = cuts_avoiding(n, chunks, extents)
            assert got == walked(n, chunks, extents) and sum(got) == n, (n, chunks, extents)


@pytest.mark.parametrize("loss", ["gold", "uld"])
@pytest.mark.parametrize("divergence, temperature, once", [
    ("forward_kl", 1.0, True),   # the logged distance is the loss's own: one GOLD/ULD term per chunk
    ("jsd", 1.0, False), ("forward_kl", 2.0, False),  # another divergence or temperature: computed apart
])
def test_the_logged_distance_is_the_loss_term_computed_once_when_their_settings_agree(loss, divergence, temperature,
                                                                                       once, monkeypatch):
    import kdsweep.losses.aligned as aligned

    ids, labels, t_ids, t_logits, spans = cross_case()
    built = targets_of(spans, reads_of(ids, 6), labels, t_ids, t_logits, student_vocab=VS, loss=loss,
                       vocab_map=VocabMap.of(PAIRS, VS, VT), kl_divergence="forward_kl")
    s_logits = rand(B, T, VS, seed=11)
    scored = []
    real_score = aligned.Aligned._score
    monkeypatch.setattr(aligned.Aligned, "_score", lambda self, *a: scored.append(1) or real_score(self, *a))
    sums = kd_loss_sums(s_logits, built.targets, labels, divergence=divergence, temperature=temperature,
                        ignore_index=IGNORE, num_chunks=1)
    assert len(scored) == (1 if once else 2)
    valid = (labels != IGNORE).reshape(-1)
    want = torch.where(valid, built.targets.kl(log_probs(s_logits.reshape(-1, VS))), 0.0).sum()
    assert sums.kl.item() == pytest.approx(want.item(), rel=1e-12)


@pytest.mark.parametrize("loss", ["gold", "uld"])
@pytest.mark.parametrize("rows_per_block", [1, 2, 4])
def test_spans_scored_in_blocks_give_one_block_s_terms_and_gradients(loss, rows_per_block, monkeypatch):
    """Each block of spans is differentiated before the next one runs (kdsweep.losses.blocks); a span's term
    and gradient are its own whatever the block, and backward weighs each span by its own upstream gradient (the
    weights here differ per position, as a mask and a mixture's would)."""
    import kdsweep.losses.blocks as blocks

    ids, labels, t_ids, t_logits, spans = cross_case()
    built = targets_of(spans, reads_of(ids, 6), labels, t_ids, t_logits, student_vocab=VS, loss=loss,
                       vocab_map=VocabMap.of(PAIRS, VS, VT))
    weights = rand(B * T, seed=8)

    def terms(elements):
        monkeypatch.setattr(blocks, "SPAN_BLOCK_ELEMENTS", elements)
        log_q = log_probs(rand(B, T, VS, seed=7).reshape(-1, VS)).detach().requires_grad_()
        d = built.targets.divergence(log_q, "forward_kl", 0.5, 1.0)
        (d * weights).sum().backward()
        return d.detach(), log_q.grad

    def plain():  # the same terms by autograd through every span at once, as written in cross_tokenizer
        t = built.targets
        log_q = log_probs(rand(B, T, VS, seed=7).reshape(-1, VS)).detach().requires_grad_()
        cont_q = log_q[t.cont].gather(-1, t.cont_token.long().unsqueeze(-1)).squeeze(-1)
        c_s = log_q.new_zeros(len(t.head)).index_add(0, t.cont_span, cont_q)
        q, p = merge(log_q[t.head], c_s), merge(t.teacher.head_log_probs(1.0), t.teacher.cont_logp(1.0))
        per_span = uld(q, p) if loss == "uld" else gold(q, p, t.vocab_map)
        d = log_q.new_zeros(B * T).index_put((t.head,), per_span)
        (d * weights).sum().backward()
        return d.detach(), log_q.grad

    want_d, want_g = plain()
    one_d, one_g = terms(10**9)
    blocked_d, blocked_g = terms(rows_per_block * VT)  # rows_per_block spans per block
    assert blocks.block_rows(VT, blocks.SPAN_BLOCK_ELEMENTS) == rows_per_block
    assert torch.equal(blocked_d, one_d) and torch.allclose(blocked_g, one_g, rtol=1e-12, atol=1e-15)
    assert torch.allclose(one_d, want_d, rtol=1e-12, atol=1e-15)
    assert torch.allclose(one_g, want_g, rtol=1e-10, atol=1e-13)
    assert want_g.abs().sum() > 0 and (one_d != 0).sum() == built.spans


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cpu_sort_gives_torch_s_values_and_an_order_that_reads_them(dtype):
    from kdsweep.losses.cross_tokenizer import sort_decreasing

    x = torch.softmax(rand(4, 3001, seed=9).to(dtype), -1)
    x[0, :10] = x[0, 10]  # ties
    want = x.sort(dim=-1, descending=True).values
    values, none = sort_decreasing(x)
    assert none is None and values.dtype == dtype and torch.equal(values, want)
    values, order = sort_decreasing(x, with_order=True)
    assert torch.equal(values, want) and torch.equal(x.gather(-1, order), want)
    assert torch.equal(order.sort(-1).values, torch.arange(3001).expand(4, -1))  # a permutation of each row
