"""Packing: bins, per-document positions and labels, length policy counts, padding; no attention across documents
in a real HF Llama (transformers 5, CPU); packed loss and gradients equal the padded ones."""

import pytest
import torch

from helpers import chunk_mb_for, tiny_llama
from kdsweep.config.schema import ConfigError
from kdsweep.data.formats import Sample
from kdsweep.data.packing import (
    apply_length_policy, bins_best_fit, bins_sequential, block_causal_mask, document_ids, pack,
)
from kdsweep.data.rows import Rows

IGNORE, PAD = -100, 0


def doc(*tokens, prompt=0):
    """The sample of full token list ``tokens`` whose first ``prompt`` tokens are not trained on."""
    return Sample(list(tokens[:-1]), [IGNORE if i < prompt else t for i, t in enumerate(tokens[1:], start=1)])


def random_docs(lengths, seed=0, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return [doc(*torch.randint(4, vocab, (n + 1,), generator=g).tolist(), prompt=n // 3) for n in lengths]


def test_bins_hold_every_index_once_within_capacity():
    lengths = [7, 1, 5, 3, 8, 2, 2, 6, 4]
    for bins in (bins_sequential(lengths, 8), bins_best_fit(lengths, 8)):
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= 8 for b in bins)
    assert bins_sequential(lengths, 8) == [[0, 1], [2, 3], [4], [5, 6], [7], [8]]
    # 5 rows instead of 6, in the order of their first sample (not longest first)
    assert bins_best_fit(lengths, 8) == [[0, 1], [2, 3], [4], [7, 5], [8, 6]]


def test_pack_rows_positions_and_labels_exactly():
    a, b, c = doc(11, 12, 13, 14), doc(21, 22, 23, prompt=2), doc(31, 32, 33, 34, 35)
    p = pack([a, b, c], 7, pad_id=PAD, strategy="sequential")
    assert p.input_ids.tolist() == [[11, 12, 13, 21, 22, 0, 0], [31, 32, 33, 34, 0, 0, 0]]
    assert p.labels.tolist() == [[12, 13, 14, IGNORE, 23, IGNORE, IGNORE], [32, 33, 34, 35] + [IGNORE] * 3]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 0, 1, 2]]
    # the last input of document a predicts a's own last token (14), never b's first (21)
    assert p.labels[0, 2] == 14 and 21 not in p.labels.tolist()[0]
    assert document_ids(p.position_ids).tolist() == [[1, 1, 1, 2, 2, 3, 3], [1, 1, 1, 1, 2, 2, 2]]
    s = p.stats
    assert (s.samples, s.tokens, s.targets, s.truncated, s.dropped, s.sequences) == (3, 9, 8, 0, 0, 2)
    assert s.padding_fraction == pytest.approx(5 / 14)


def test_length_policy_truncates_or_drops_and_counts():
    long, short, promptonly = doc(1, 2, 3, 4, 5, 6), doc(7, 8), doc(9, 10, 11, 12, 13, prompt=4)
    kept, counts = apply_length_policy([long, short, promptonly], 3, "truncate")
    assert kept == [Sample([1, 2, 3], [2, 3, 4]), short]  # promptonly is cut before its response: dropped
    assert (counts.samples, counts.tokens, counts.targets, counts.truncated, counts.dropped) == (2, 4, 4, 2, 1)
    kept, counts = apply_length_policy([long, short, promptonly], 3, "drop")
    assert kept == [short] and (counts.truncated, counts.dropped) == (0, 2)
    assert pack([short, Sample([], [])], 4, pad_id=PAD).stats.dropped == 1  # empty samples never enter a row


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"policy": "wrap"}, r"unknown truncation policy 'wrap'; use one of truncate, drop$"),
     ({"strategy": "ffd"}, r"unknown packing strategy 'ffd'; use one of best_fit, sequential$")],
)
def test_bad_policies_are_one_line(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        pack([doc(1, 2)], 4, pad_id=PAD, **kwargs)


def padded_rows(samples):
    return Rows.from_rows([s.input_ids for s in samples], [s.labels for s in samples], None,
                          [len(s) for s in samples], pad_id=PAD, ignore_index=IGNORE)


def packed_rows(p):
    return Rows.from_rows(p.input_ids, p.labels, p.position_ids, p.used, pad_id=PAD, ignore_index=IGNORE)


def test_padded_rows_batch_to_the_longest_with_ignored_labels():
    rows = padded_rows([doc(1, 2, 3), doc(4, 5, 6, 7, prompt=1), doc(8, 9, 10)])
    b = rows.batch([0, 1])
    assert b.input_ids.tolist() == [[1, 2, 0], [4, 5, 6]]
    assert b.labels.tolist() == [[2, 3, IGNORE], [5, 6, 7]]
    assert b.attention_mask.tolist() == [[1, 1, 0], [1, 1, 1]] and b.position_ids is None
    same = rows.batch([0, 2])  # equal lengths: nothing to pad, no mask
    assert same.attention_mask is None and same.input_ids.tolist() == [[1, 2], [8, 9]]
    assert (rows.batch([1], mask_labels=True).labels == IGNORE).all()


def test_block_causal_mask_allows_only_earlier_tokens_of_the_same_document():
    m = block_causal_mask(torch.tensor([[0, 1, 0, 1, 2]]))
    allowed = (m[0, 0] == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]


@pytest.fixture(scope="module")
def packed():
    samples = random_docs([5, 3, 7, 4, 2, 6])
    return samples, pack(samples, 12, pad_id=PAD)


def per_document(p):
    """(row, start, end) of each non-padding document of a packed batch."""
    spans = []
    for row in range(p.input_ids.shape[0]):
        starts = (p.position_ids[row] == 0).nonzero().flatten().tolist() + [p.input_ids.shape[1]]
        spans += [(row, a, b) for a, b in zip(starts, starts[1:]) if (p.labels[row, a:b] != IGNORE).any()]
    return spans


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("mechanism", ["position_ids", "block_mask"])
def test_no_attention_crosses_a_document_boundary(packed, impl, mechanism):
    samples, p = packed
    model = tiny_llama().eval()
    model.set_attn_implementation(impl)
    mask = block_causal_mask(p.position_ids) if mechanism == "block_mask" else None
    with torch.no_grad():
        logits = model(input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=mask).logits
        spans = per_document(p)
        assert len(spans) == len(samples) and p.stats.sequences < len(samples)
        for row, a, b in spans:
            alone = model(input_ids=p.input_ids[row : row + 1, a:b]).logits[0]
            torch.testing.assert_close(logits[row, a:b], alone, atol=1e-5, rtol=1e-5)


def test_an_all_ones_attention_mask_turns_transformers_packing_detection_off(packed):
    """Why the packed batch must go in with attention_mask=None (or a 4D block mask): this is what the test above
    would see if documents attended to each other."""
    _, p = packed
    model = tiny_llama().eval()
    row, a, b = next(s for s in per_document(p) if s[1] > 0)  # a document that is not first in its row
    with torch.no_grad():
        ones = torch.ones_like(p.input_ids)
        leaky = model(input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=ones).logits
        alone = model(input_ids=p.input_ids[row : row + 1, a:b]).logits[0]
    assert (leaky[row, a:b] - alone).abs().max() > 1e-3


@pytest.mark.parametrize("impl, chunks", [("chunked", 1), ("chunked", 3), ("fused", 3)])
def test_packed_loss_and_gradients_equal_the_padded_ones(packed, impl, chunks):
    """The training step's own micro-batch backward (teacher and student forwards, KD + CE sums) on the packed
    rows, and on the same samples one per row, padded: in one chunk (the plain graph), and in 3 or more."""
    from kdsweep.config.schema import LossConfig
    from kdsweep.teacher.live import LiveTeacher
    from kdsweep.train.step import micro_batch_backward

    samples, p = packed
    student, teacher = tiny_llama(seed=0), tiny_llama(seed=1).eval()
    packed_batch = packed_rows(p).batch(range(p.stats.sequences))
    cfg = LossConfig(kd_ratio=0.5, impl=impl, chunk_mb=chunk_mb_for(chunks, packed_batch.labels.numel(), 96))

    def loss_and_grads(batch):
        student.zero_grad()
        with LiveTeacher(teacher, fused=impl == "fused").targets(batch) as targets:
            sums = micro_batch_backward(student, targets, batch, cfg, torch.tensor(1.0))
        return sums, {n: q.grad.clone() for n, q in student.named_parameters()}

    padded_batch = padded_rows(samples).batch(range(len(samples)))
    assert packed_batch.position_ids is not None and packed_batch.attention_mask is None
    assert padded_batch.attention_mask is not None
    (pk, pk_grads), (pd, pd_grads) = loss_and_grads(packed_batch), loss_and_grads(padded_batch)
    assert int(pk.tokens) == int(pd.tokens) == p.stats.targets
    for a, b in zip(pk, pd):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for name, g in pd_grads.items():
        torch.testing.assert_close(pk_grads[name], g, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("n_rows,world,batch", [(2, 4, 8), (1, 2, 1), (7, 3, 2), (16, 2, 4)])
def test_every_rank_gets_as_many_eval_batches_and_each_row_counts_once(n_rows, world, batch):
    """Ranks of a sharded model must run the same number of forwards, even with fewer held-out rows than ranks."""
    from kdsweep.distributed import DistEnv
    from kdsweep.train.trial import eval_batches_of_rank

    rows = padded_rows(random_docs([3 + i % 4 for i in range(n_rows)]))
    per_rank = [eval_batches_of_rank(rows, batch, DistEnv(rank=r, world_size=world), torch.device("cpu"))
                for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1
    counted = sum(int((b.labels != IGNORE).sum()) for bs in per_rank for b in bs)
    assert counted == int((rows.labels != IGNORE).sum())
