"""A cross-tokenizer teacher's targets, built from the spans of each row (:mod:`kdsweep.teacher.align`) and the
teacher's logits on its own tokens of the same rows: :class:`~kdsweep.losses.aligned.Aligned`, on the student's
positions.

A span of student tokens and teacher tokens ``c … d−1`` takes one KD term at the student position that predicts its
first token (the student's sequence is its inputs and the targets that are not inputs, each with the position that
predicts it: :class:`~kdsweep.teacher.reader.Read`), when that position and those predicting the span's other
tokens are trained (their labels are not ignored) and the teacher has a position ``c − 1`` before the span. A
span with trained positions that cannot take its term (part of it untrained, or no teacher position before it) is
dropped and counted (:attr:`CrossTargets.dropped`), never silently; the row's first token has no position to train.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from kdsweep.data.batch import Batch
from kdsweep.losses.aligned import Aligned, LiveSpans
from kdsweep.losses.cross_tokenizer import VocabMap
from kdsweep.models.heads import frozen_hidden, frozen_projection
from kdsweep.teacher.align import Span, align_spans, shared_vocab
from kdsweep.teacher.reader import RowReader, vocab_bytes
from kdsweep.teacher.source import TeacherSource
from kdsweep.teacher.views import ViewReads


@dataclass
class CrossTargets:
    targets: Aligned
    spans: int
    """Spans that take a KD term."""
    dropped: int
    """Spans that cannot (untrained positions inside, or no teacher position before them)."""
    row_dropped: list[int]
    """``dropped`` per row."""


def aligned_targets(
    row_spans: Sequence[Sequence[Span]],
    reads: Sequence[Any],
    labels: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_rows: Callable[[torch.Tensor], torch.Tensor],
    *,
    ignore_index: int,
    student_vocab: int,
    loss: str,
    vocab_map: VocabMap | None,
    w_matched: float | None = None,
    w_unmatched: float | None = None,
    kl_divergence: str = "forward_kl",
    kl_beta: float = 0.5,
) -> CrossTargets:
    """``row_spans[b]``: row b's spans over ``reads[b].student_ids`` (the student's tokens, each predicted by the
    position ``reads[b].predictor`` gives) and the teacher's tokens ``teacher_ids`` ``[B, Tt]``, whose logits at flattened
    positions ``index`` are ``teacher_rows(index)`` (made one chunk's spans at a time: :class:`LiveSpans`); ``labels``
    ``[B, T]``. Student positions are flattened row by row."""
    B, T = labels.shape
    Tt = teacher_ids.shape[1]
    trained, t_ids = (labels != ignore_index).tolist(), teacher_ids.tolist()
    head, cont, cont_span, cont_token = [], [], [], []
    t_head, t_first, t_cont, t_cont_token, t_cont_span, t_cont_count = [], [], [], [], [], []
    extent, row_dropped = [], [0] * B
    for b, (spans, read) in enumerate(zip(row_spans, reads)):
        for span in spans:
            (a, e), (c, d) = span.student, span.teacher
            by = read.predictor[a:e]
            if by[0] is None:  # a document's (or the row's) first token: no student position predicts it
                continue
            # the teacher needs a position before the span in the same document (its positions restart with each)
            no_context = c < 1 or read.teacher_positions[c] == 0
            if no_context or None in by or not all(trained[b][p] for p in by):
                row_dropped[b] += int(any(p is not None and trained[b][p] for p in by))  # prompt tokens never were
                continue
            k = len(extent)
            extent.append((b * T + by[0], b * T + by[-1]))
            head.append(b * T + by[0])
            for j in range(a + 1, e):
                cont.append(b * T + read.predictor[j])
                cont_span.append(k)
                cont_token.append(read.student_ids[j])
            t_head.append(b * Tt + c - 1)
            t_first.append(t_ids[b][c])
            for u in range(c, d - 1):
                t_cont.append(b * Tt + u)
                t_cont_token.append(t_ids[b][u + 1])
                t_cont_span.append(k)
            t_cont_count.append(d - 1 - c)
    long = lambda xs: torch.tensor(xs, dtype=torch.long, device=teacher_ids.device)
    teacher = LiveSpans(teacher_rows, long(t_head), long(t_first), long(t_cont), long(t_cont_token), long(t_cont_span),
                        t_cont_count)
    targets = Aligned(
        n=B * T, head=long(head), cont=long(cont), cont_span=long(cont_span), cont_token=long(cont_token),
        teacher=teacher, extent=extent, student_vocab=student_vocab, loss=loss, vocab_map=vocab_map,
        w_matched=w_matched, w_unmatched=w_unmatched, kl_divergence=kl_divergence, kl_beta=kl_beta,
    )
    return CrossTargets(targets, spans=len(extent), dropped=sum(row_dropped), row_dropped=row_dropped)


def rows_of(logits: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The teacher rows of kept logits ``[..., Vt]``, by flattened position (``aligned_targets``'s ``teacher_rows``)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return lambda index: flat[index]


def vocab_map_of(student: Any, teacher: Any, teacher_vocab: int) -> VocabMap:
    """The tokens the two tokenizers share: the same bytes; and special tokens of the same text, or the same role
    (BOS with BOS, EOS with EOS)."""
    def entries(tok: Any) -> list[tuple[int, bytes, bool]]:
        return [(i, *e) for i, e in enumerate(vocab_bytes(tok)) if e is not None]

    pairs = shared_vocab(entries(student), entries(teacher))
    t_special = {teacher.convert_ids_to_tokens(i): i for i in teacher.all_special_ids}
    specials = [(i, t_special.get(student.convert_ids_to_tokens(i))) for i in student.all_special_ids]
    specials += [(getattr(student, f"{r}_token_id"), getattr(teacher, f"{r}_token_id")) for r in ("eos", "bos")]
    taken_s, taken_t = set(), set()
    for a, b in specials:
        if a is not None and b is not None and a not in taken_s and b not in taken_t:
            pairs.append((a, b))
            taken_s.add(a)
            taken_t.add(b)
    return VocabMap.of(sorted(pairs), len(student), teacher_vocab)


class CrossTokenizerTeacher(TeacherSource):
    """A live teacher with its own tokenizer (a :class:`~kdsweep.teacher.source.TeacherSource`): each student row is
    read in the teacher's tokens (:class:`~kdsweep.teacher.reader.RowReader`; chat rows in its own template:
    :class:`~kdsweep.teacher.views.ViewReads`), the teacher runs on those, and its targets come back on the
    student's positions (:class:`~kdsweep.losses.aligned.Aligned`). ``split``: the rows its batches come from.
    ``fused`` (``loss.impl=fused``): the teacher gives its final hidden states, and only the rows a chunk's spans
    read are projected by its output layer, one chunk at a time, so its ``[positions, Vt]`` logits never exist."""

    def __init__(self, model: nn.Module, reader: RowReader | ViewReads, vocab_map: VocabMap, *, loss: str,
                 ignore_index: int, student_vocab: int, max_positions: int, pad_id: int, w_matched: float | None = None,
                 w_unmatched: float | None = None, kl_divergence: str = "forward_kl", kl_beta: float = 0.5,
                 split: str = "train", fused: bool = False) -> None:
        self.model, self.reader, self.vocab_map, self.split, self.fused = model, reader, vocab_map, split, fused
        self.loss, self.ignore_index, self.student_vocab = loss, ignore_index, student_vocab
        self.max_positions, self.pad_id = max_positions, pad_id
        self.weights, self.kl = (w_matched, w_unmatched), (kl_divergence, kl_beta)
        self.tokens_computed, self.tokens_read = 0, 0
        self.kd_spans, self.kd_spans_dropped, self.tokens_unaligned = 0, 0, 0
        """KD spans taken, spans that could not take a term, and student content tokens in no span (cut rows)."""

    @contextmanager
    def built(self, batch: Batch, split: str | None = None) -> Iterator[tuple[CrossTargets, list[int]]]:
        """The batch's targets (its rows from ``split``, default this teacher's), and per row its student content
        tokens in no span (a row the teacher's reading changed, or cut); valid until the context ends."""
        reads = self.reader.read_batch(batch, split or self.split, self.ignore_index)
        ids = batch.input_ids.tolist()
        width = max(1, min(self.max_positions, max(len(r.teacher_ids) for r in reads)))
        t_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        t_pos = torch.arange(width).repeat(len(ids), 1)
        for b, r in enumerate(reads):
            n = min(width, len(r.teacher_ids))
            t_ids[b, :n] = torch.tensor(r.teacher_ids[:n], dtype=torch.long)
            t_pos[b, :n] = torch.tensor(r.teacher_positions[:n], dtype=torch.long)
        device = batch.input_ids.device
        t_ids, t_pos = t_ids.to(device), t_pos.to(device)
        self.tokens_computed += t_ids.numel()
        inputs = {"input_ids": t_ids, "position_ids": t_pos, "use_cache": False}  # right padding needs no mask
        with torch.no_grad():  # causal; packed documents: their position ids
            out = frozen_hidden(self.model, inputs) if self.fused else self.model(**inputs).logits
        row_spans, unaligned = [], []
        for r in reads:
            try:
                alignment = align_spans(r.text, r.student, r.teacher[:width], r.skipped)
            except ValueError:  # this row's text came back changed (check_reads saw none): no KD term, counted
                row_spans.append([])
                unaligned.append(sum(o is not None for o in r.student))
                continue
            row_spans.append(alignment.spans)
            unaligned.append(alignment.unaligned[0])
        flat = out.reshape(-1, out.shape[-1])
        with (frozen_projection(self.model) if self.fused else nullcontext(lambda rows: rows)) as head:
            built = aligned_targets(row_spans, reads, batch.labels, t_ids, lambda index: head(flat[index]),
                                    ignore_index=self.ignore_index, student_vocab=self.student_vocab, loss=self.loss,
                                    vocab_map=self.vocab_map, w_matched=self.weights[0], w_unmatched=self.weights[1],
                                    kl_divergence=self.kl[0], kl_beta=self.kl[1])
            yield built, unaligned

    @contextmanager
    def targets(self, batch: Batch) -> Iterator[Aligned]:
        with self.built(batch) as (built, unaligned):
            self.kd_spans, self.kd_spans_dropped = self.kd_spans + built.spans, self.kd_spans_dropped + built.dropped
            self.tokens_unaligned += sum(unaligned)
            yield built.targets


__all__ = ["CrossTargets", "CrossTokenizerTeacher", "aligned_targets", "rows_of", "vocab_map_of"]
