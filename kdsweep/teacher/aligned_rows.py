"""A teacher with another tokenizer's reading of every row, aligned once when the rows are tokenized and kept beside
them, so a training step reads its batch's spans back as tensors: no per-token Python, no host sync.

Per row (:class:`RowPlan`): the teacher's tokens of it and their positions (:class:`~kdsweep.teacher.reader.RowReader`,
or a chat row's views: :class:`~kdsweep.teacher.views.ViewReads`), cut at the teacher's context; and each span that
takes a KD term (:mod:`kdsweep.teacher.cross`'s rules) as four numbers: its head (the student position predicting its
first token), its student width (the positions ``head + 1 … head + width`` predict its later tokens), its first
teacher token ``c`` (the teacher row ``c − 1`` predicts it) and its teacher length (rows ``c … c + length − 2``
predict the rest); and the spans it dropped and its student tokens in no span. A split's plans are stored flat
(:class:`AlignedRows`, ``<data cache>/aligned-<key>/<split>.pt``, memory-mapped by every rank and trial); a batch's
(:class:`BatchPlan`) are its rows' slices, moved to flattened positions.

Grows as the rows: ~24 bytes per token (a teacher token's id and position, a span's four numbers), built once in
O(tokens) Python per (rows, teacher tokenizer) pair and shared by every trial of a sweep.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from kdsweep.data import integrity
from kdsweep.data.batch import Batch
from kdsweep.data.cache import built_once
from kdsweep.teacher.align import Span, align_spans
from kdsweep.teacher.reader import Read

log = logging.getLogger(__name__)

PLANS_VERSION = 1
"""Bump when the plans made from the same rows and tokenizers change, so plans kept with the rows are not reused."""


@dataclass(frozen=True)
class RowPlan:
    """One row's teacher tokens and spans (the module docstring), row-local."""

    spans: torch.Tensor
    """``[S, 4]`` int32: head, student width, first teacher token, teacher length."""
    teacher_ids: torch.Tensor
    """``[n]`` int32"""
    teacher_positions: torch.Tensor
    """``[n]`` int32: each document's from 0, as the student's."""
    dropped: int = 0
    """Spans with trained positions that cannot take a term (part of them untrained, no teacher position before)."""
    unaligned: int = 0
    """Student content tokens in no span (a row cut inside one, or a row whose text the teacher's reading changed)."""


def span_plan(spans: Sequence[Span], read: Read,
              trained: Sequence[bool]) -> tuple[list[tuple[int, int, int, int]], int]:
    """The spans of ``read`` that take a KD term (as ``(head, width, c, length)``), and how many were dropped.

    A span of student tokens and teacher tokens ``c … d−1`` takes one at the student position that predicts its first
    token, when that position and those predicting its other tokens are trained (``trained[p]``: the label of position
    p is not ignored) and the teacher has a position ``c − 1`` before it in the same document; a span with trained
    positions that cannot is dropped (counted); a document's first token has no position to train."""
    kept, dropped = [], 0
    for span in spans:
        (a, e), (c, d) = span.student, span.teacher
        by = read.predictor[a:e]
        if by[0] is None:  # a document's (or the row's) first token: no student position predicts it
            continue
        no_context = c < 1 or read.teacher_positions[c] == 0  # the teacher's positions restart with each document
        if no_context or None in by or not all(trained[p] for p in by):
            dropped += int(any(p is not None and trained[p] for p in by))  # prompt tokens never were
            continue
        kept.append((by[0], by[-1] - by[0], c, d - c))  # predictors of one span's tokens are consecutive
    return kept, dropped


def row_plan(read: Read, trained: Sequence[bool], max_positions: int) -> RowPlan:
    """``read`` aligned, its teacher tokens cut at ``max_positions`` (a row whose text came back changed, which
    :func:`~kdsweep.teacher.job.check_reads` saw in none of the first rows, takes no term: its tokens are counted)."""
    n = min(len(read.teacher_ids), max_positions)
    try:
        alignment = align_spans(read.text, read.student, read.teacher[:n], read.skipped)
        spans, dropped = span_plan(alignment.spans, read, trained)
        unaligned = alignment.unaligned[0]
    except ValueError:
        spans, dropped, unaligned = [], 0, sum(o is not None for o in read.student)
    int32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
    return RowPlan(int32(spans).reshape(-1, 4), int32(read.teacher_ids[:n]), int32(read.teacher_positions[:n]),
                   dropped, unaligned)


@dataclass(frozen=True)
class BatchPlan:
    """A micro-batch's rows' plans on its flattened positions (student ``b·T + t``, teacher ``b·W + u``), on the CPU."""

    spans: torch.Tensor
    """``[S, 4]`` int64: head, student width, first teacher token, teacher length (heads ascend)."""
    teacher_ids: torch.Tensor
    """``[B, W]`` int64, right-padded with the teacher's pad id (W: the longest row's, at least 1)."""
    teacher_positions: torch.Tensor
    """``[B, W]`` int64"""
    dropped: list[int]
    unaligned: list[int]

    @classmethod
    def of(cls, rows: Sequence[RowPlan], length: int, pad_id: int) -> "BatchPlan":
        """``rows`` (each row's plan) in a batch of ``length`` student positions."""
        width = max(1, max(len(r.teacher_ids) for r in rows))
        t_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        t_pos = torch.arange(width).repeat(len(rows), 1)  # the padding tail: positions that go on
        for b, r in enumerate(rows):
            t_ids[b, :len(r.teacher_ids)] = r.teacher_ids
            t_pos[b, :len(r.teacher_ids)] = r.teacher_positions
        counts = torch.tensor([len(r.spans) for r in rows])
        row = torch.repeat_interleave(torch.arange(len(rows)), counts)
        spans = torch.cat([r.spans for r in rows]).long() if rows else torch.zeros(0, 4, dtype=torch.long)
        spans[:, 0] += row * length
        spans[:, 2] += row * width
        return cls(spans, t_ids, t_pos, [r.dropped for r in rows], [r.unaligned for r in rows])


class AlignedRows:
    """A split's :class:`RowPlan` s, flat: ``spans`` ``[ΣS, 4]`` and ``spans_at`` (row i's are
    ``spans_at[i]:spans_at[i+1]``), ``teacher_ids``/``teacher_positions`` and ``teacher_at``, ``counts`` ``[N, 2]``
    (dropped, unaligned)."""

    def __init__(self, tensors: dict[str, torch.Tensor], pad_id: int) -> None:
        self.t, self.pad_id = tensors, pad_id
        self.spans_at, self.teacher_at = tensors["spans_at"].tolist(), tensors["teacher_at"].tolist()
        self.counts = tensors["counts"].tolist()

    @classmethod
    def of(cls, plans: Sequence[RowPlan], pad_id: int) -> "AlignedRows":
        at = lambda sizes: torch.tensor([0, *sizes], dtype=torch.int64).cumsum(0)
        cat = lambda xs, empty: torch.cat(xs) if xs else empty
        return cls({
            "spans": cat([p.spans for p in plans], torch.zeros(0, 4, dtype=torch.int32)),
            "spans_at": at(len(p.spans) for p in plans),
            "teacher_ids": cat([p.teacher_ids for p in plans], torch.zeros(0, dtype=torch.int32)),
            "teacher_positions": cat([p.teacher_positions for p in plans], torch.zeros(0, dtype=torch.int32)),
            "teacher_at": at(len(p.teacher_ids) for p in plans),
            "counts": torch.tensor([[p.dropped, p.unaligned] for p in plans], dtype=torch.int32).reshape(-1, 2),
        }, pad_id)

    @classmethod
    def build(cls, reader: Any, rows: Any, split: str, max_positions: int, pad_id: int,
              every: int = 64) -> "AlignedRows":
        """Every row of ``rows`` (:class:`~kdsweep.data.rows.Rows`) as ``reader`` reads it, aligned."""
        plans, t0, said = [], time.perf_counter(), time.perf_counter()
        for lo in range(0, len(rows), every):
            batch = rows.batch(torch.arange(lo, min(lo + every, len(rows))))
            trained = (batch.labels != rows.ignore_index).tolist()
            plans += [row_plan(read, t, max_positions)
                      for read, t in zip(reader.read_batch(batch, split, rows.ignore_index), trained)]
            if time.perf_counter() - said > 60:
                said = time.perf_counter()
                log.info("teacher alignment: %s: %d of %d rows in %.0f s", split, len(plans), len(rows), said - t0)
        return cls.of(plans, pad_id)

    def __len__(self) -> int:
        return len(self.counts)

    def row(self, i: int) -> RowPlan:
        (s0, s1), (t0, t1) = self.spans_at[i:i + 2], self.teacher_at[i:i + 2]
        t = self.t
        return RowPlan(t["spans"][s0:s1], t["teacher_ids"][t0:t1], t["teacher_positions"][t0:t1], *self.counts[i])

    def plan(self, batch: Batch) -> BatchPlan:
        """The plan of a batch of these rows (made by :meth:`~kdsweep.data.rows.Rows.batch`: it carries their
        indices)."""
        if batch.rows is None:
            raise ValueError("a teacher with another tokenizer reads batches made by Rows.batch (they carry their row "
                             "indices, and each row's alignment was made with the rows)")
        return BatchPlan.of([self.row(i) for i in batch.rows.tolist()], batch.input_ids.shape[1], self.pad_id)

    def save(self, path: Path) -> None:
        integrity.save(self.t, path)

    @classmethod
    def load(cls, path: Path, pad_id: int) -> "AlignedRows":
        return cls(integrity.load(path), pad_id)


def plans_key(teacher: Any, max_positions: int, ignore_index: int) -> str:
    """What a split's plans depend on beyond its rows (their cache key holds the student's tokenizer and any chat
    views): the teacher's tokenizer (vocabulary, normaliser, special tokens), its context and the ignored label."""
    backend = getattr(teacher, "backend_tokenizer", None)
    spec = backend.to_str() if backend is not None else repr(sorted(teacher.get_vocab().items()))
    what = (PLANS_VERSION, spec, sorted(teacher.all_special_ids), max_positions, ignore_index)
    return hashlib.sha256(repr(what).encode()).hexdigest()[:16]


def aligned_splits(reader: Any, data: Any, teacher: Any, max_positions: int, pad_id: int) -> dict[str, AlignedRows]:
    """Per split of ``data`` (a :class:`~kdsweep.data.dataset.RunData`), its rows' plans: made by the first job that
    needs them (every rank and trial waits on one lock) and kept in the rows' cache directory."""
    ignore_index = data.train.ignore_index
    name = f"aligned-{plans_key(teacher, max_positions, ignore_index)}"
    splits = {"train": data.train, "eval": data.eval}
    with built_once(data.cache_dir, name, "the teacher's alignment of the rows") as (final, tmp):
        if tmp is not None:
            t0 = time.perf_counter()
            for split, rows in splits.items():
                AlignedRows.build(reader, rows, split, max_positions, pad_id).save(tmp / f"{split}.pt")
            log.info("teacher alignment: %s rows read in the teacher's tokens and aligned in %.2f s, kept in %s",
                     " + ".join(str(len(r)) for r in splits.values()), time.perf_counter() - t0, final)
    return {split: AlignedRows.load(final / f"{split}.pt", pad_id) for split in splits}


__all__ = ["AlignedRows", "BatchPlan", "PLANS_VERSION", "RowPlan", "aligned_splits", "plans_key", "row_plan",
           "span_plan"]
