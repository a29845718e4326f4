"""A teacher with another tokenizer's reading of each row, aligned once with the rows (kdsweep.teacher.aligned_rows):
a step reads its batch's spans back without reading or aligning anything, a row's plan is the same in any batch and
after a round trip through its file, and the teacher's tokens are cut at its context."""

from __future__ import annotations

import pytest
import torch

from helpers import one_thread  # noqa: F401
from kdsweep.data.batch import Batch
from kdsweep.losses import kd_loss_sums
from kdsweep.teacher import aligned_rows
from kdsweep.teacher.aligned_rows import AlignedRows
from kdsweep.teacher.reader import RowReader
from test_align import tokenizer
from test_cross_source import IGNORE, source, student_rows, tiny_model


def test_a_step_reads_its_spans_back_without_reading_or_aligning_a_row(monkeypatch):
    rows = student_rows("byte_level", packed=True, T=40)
    batch = rows.batch(torch.arange(2))
    s, t = tokenizer("byte_level"), tokenizer("metaspace")
    cross = source("byte_level", "metaspace", tiny_model(len(t), seed=2), rows)
    logits = torch.randn(*batch.input_ids.shape, len(s), generator=torch.Generator().manual_seed(3))
    with cross.targets(batch) as aligned:
        want = kd_loss_sums(logits, aligned, batch.labels, ignore_index=IGNORE, num_chunks=3)

    def never(*args, **kwargs):
        raise AssertionError("a step read or aligned a row")

    monkeypatch.setattr(RowReader, "read", never)
    monkeypatch.setattr(RowReader, "read_batch", never)
    monkeypatch.setattr(aligned_rows, "align_spans", never)
    with cross.targets(batch) as aligned:
        got = kd_loss_sums(logits, aligned, batch.labels, ignore_index=IGNORE, num_chunks=3)
    assert got.kd.item() == want.kd.item() > 0 and cross.kd_spans == 2 * len(aligned.extent)


def test_a_rows_plan_is_the_same_in_any_batch_and_after_its_file(tmp_path):
    rows = student_rows("byte_level", packed=False, T=40)
    t = tokenizer("metaspace")
    built = AlignedRows.build(RowReader(tokenizer("byte_level"), t), rows, "train", 128, t.pad_token_id, every=1)
    built.save(tmp_path / "train.pt")
    table = AlignedRows.load(tmp_path / "train.pt", t.pad_token_id)
    both, alone = table.plan(rows.batch([0, 1])), table.plan(rows.batch([1]))
    T, W = 40, both.teacher_ids.shape[1]
    first = len(table.row(0).spans)
    moved = alone.spans + torch.tensor([T, 0, W, 0])
    assert torch.equal(both.spans[first:], moved) and first > 0
    n = alone.teacher_ids.shape[1]
    assert torch.equal(both.teacher_ids[1, :n], alone.teacher_ids[0]) and (both.teacher_ids[1, n:] == t.pad_token_id).all()
    assert both.dropped == [built.row(i).dropped for i in range(2)]
    with pytest.raises(ValueError, match="Rows.batch"):
        one = rows.batch([0])
        table.plan(Batch(one.input_ids, one.labels))  # a batch that does not say which rows it holds


def test_the_teachers_tokens_are_cut_at_its_context_and_what_the_cut_leaves_is_counted():
    rows = student_rows("byte_level", packed=True, T=100)
    s, t = tokenizer("byte_level"), tokenizer("metaspace")
    whole = AlignedRows.build(RowReader(s, t), rows, "train", 128, t.pad_token_id)
    cut = AlignedRows.build(RowReader(s, t), rows, "train", 12, t.pad_token_id)
    for i in range(2):
        a, b = whole.row(i), cut.row(i)
        assert len(a.teacher_ids) > 12 == len(b.teacher_ids) and torch.equal(a.teacher_ids[:12], b.teacher_ids)
        assert (b.spans[:, 2] + b.spans[:, 3] <= 12).all() and 0 < len(b.spans) < len(a.spans)
        assert b.unaligned > a.unaligned
