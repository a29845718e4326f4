"""A cross-tokenizer teacher's targets, built from the spans of each row (:mod:`kdsweep.teacher.align`, kept with the
rows: :mod:`kdsweep.teacher.aligned_rows`) and the teacher's logits on its own tokens of the same rows:
:class:`~kdsweep.losses.aligned.Aligned`, on the student's positions.

A span of student tokens and teacher tokens ``c … d−1`` takes one KD term at the student position that predicts its
first token (the student's sequence is its inputs and the targets that are not inputs, each with the position that
predicts it: :class:`~kdsweep.teacher.reader.Read`), when that position and those predicting the span's other
tokens are trained (their labels are not ignored) and the teacher has a position ``c − 1`` before the span
(:func:`~kdsweep.teacher.aligned_rows.span_plan`). A span with trained positions that cannot take its term (part of it
untrained, or no teacher position before it) is dropped and counted (:attr:`CrossTargets.dropped`), never silently;
the row's first token has no position to train.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from kdsweep.data.batch import Batch
from kdsweep.losses.aligned import Aligned, LiveSpans
from kdsweep.losses.cross_tokenizer import VocabMap
from kdsweep.models.heads import frozen_hidden, frozen_projection
from kdsweep.teacher.align import shared_vocab
from kdsweep.teacher.aligned_rows import AlignedRows, BatchPlan
from kdsweep.teacher.reader import vocab_bytes
from kdsweep.teacher.source import TeacherSource


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
    plan: BatchPlan,
    labels: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_rows: Callable[[torch.Tensor], torch.Tensor],
    *,
    student_vocab: int,
    loss: str,
    vocab_map: VocabMap | None,
    w_matched: float | None = None,
    w_unmatched: float | None = None,
    kl_divergence: str = "forward_kl",
    kl_beta: float = 0.5,
) -> CrossTargets:
    """A batch's targets from its rows' spans (``plan``, on the CPU: :class:`~kdsweep.teacher.aligned_rows.BatchPlan`)
    and the teacher's tokens ``teacher_ids`` ``[B, W]`` (on the device), whose logits at flattened positions ``index``
    are ``teacher_rows(index)`` (made one chunk's spans at a time: :class:`LiveSpans`); ``labels`` ``[B, T]``. Index
    arithmetic on the CPU, gathers on the device: no Python per token, no host sync."""
    head, width, c, length = plan.spans.t().contiguous()
    device = teacher_ids.device
    move = lambda t: t.to(device, non_blocking=True)

    def runs(start: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``start[s] … start[s] + count[s] − 1`` for every s, flat, and each one's s."""
        owner = torch.repeat_interleave(torch.arange(len(count)), count)
        return start[owner] + torch.arange(len(owner)) - (count.cumsum(0) - count)[owner], owner

    cont, cont_span = runs(head + 1, width)
    t_cont, t_cont_span = runs(c, length - 1)
    flat_ids = teacher_ids.reshape(-1)
    # a continuation position is trained (its label is its token) but in a batch whose labels are all ignored
    cont_token = labels.reshape(-1)[move(cont)].clamp_min(0)
    teacher = LiveSpans(teacher_rows, move(c - 1), flat_ids[move(c)], move(t_cont), flat_ids[move(t_cont + 1)],
                        move(t_cont_span), (length - 1).tolist())
    targets = Aligned(
        n=labels.numel(), head=move(head), cont=move(cont), cont_span=move(cont_span), cont_token=cont_token,
        teacher=teacher, extent=list(zip(head.tolist(), (head + width).tolist())), student_vocab=student_vocab,
        loss=loss, vocab_map=vocab_map, w_matched=w_matched, w_unmatched=w_unmatched, kl_divergence=kl_divergence,
        kl_beta=kl_beta,
    )
    return CrossTargets(targets, spans=len(head), dropped=sum(plan.dropped), row_dropped=plan.dropped)


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
    """A live teacher with its own tokenizer (a :class:`~kdsweep.teacher.source.TeacherSource`): each student row was
    read in the teacher's tokens and aligned when the rows were made (``reads``: per split, its rows' plans,
    :class:`~kdsweep.teacher.aligned_rows.AlignedRows`), the teacher runs on those tokens, and its targets come back
    on the student's positions (:class:`~kdsweep.losses.aligned.Aligned`). ``split``: the rows its batches come
    from. ``fused`` (``loss.impl=fused``): the teacher gives its final hidden states, and only the rows a chunk's
    spans read are projected by its output layer, one chunk at a time, so its ``[positions, Vt]`` logits never
    exist."""

    def __init__(self, model: nn.Module, reads: dict[str, AlignedRows], vocab_map: VocabMap, *, loss: str,
                 student_vocab: int, w_matched: float | None = None, w_unmatched: float | None = None,
                 kl_divergence: str = "forward_kl", kl_beta: float = 0.5, split: str = "train",
                 fused: bool = False) -> None:
        self.model, self.reads, self.vocab_map, self.split, self.fused = model, reads, vocab_map, split, fused
        self.loss, self.student_vocab = loss, student_vocab
        self.weights, self.kl = (w_matched, w_unmatched), (kl_divergence, kl_beta)
        self.tokens_computed, self.tokens_read = 0, 0
        self.kd_spans, self.kd_spans_dropped, self.tokens_unaligned = 0, 0, 0
        """KD spans taken, spans that could not take a term, and student content tokens in no span (cut rows)."""

    @contextmanager
    def built(self, batch: Batch, split: str | None = None) -> Iterator[tuple[CrossTargets, list[int]]]:
        """The batch's targets (its rows from ``split``, default this teacher's), and per row its student content
        tokens in no span (a row the teacher's reading changed, or cut); valid until the context ends."""
        plan = self.reads[split or self.split].plan(batch)
        device = batch.input_ids.device
        t_ids = plan.teacher_ids.to(device, non_blocking=True)
        self.tokens_computed += t_ids.numel()
        inputs = {"input_ids": t_ids, "position_ids": plan.teacher_positions.to(device, non_blocking=True),
                  "use_cache": False}  # right padding needs no mask
        with torch.no_grad():  # causal; packed documents: their position ids
            out = frozen_hidden(self.model, inputs) if self.fused else self.model(**inputs).logits
        flat = out.reshape(-1, out.shape[-1])
        with (frozen_projection(self.model) if self.fused else nullcontext(lambda rows: rows)) as head:
            built = aligned_targets(plan, batch.labels, t_ids, lambda index: head(flat[index]),
                                    student_vocab=self.student_vocab, loss=self.loss, vocab_map=self.vocab_map,
                                    w_matched=self.weights[0], w_unmatched=self.weights[1], kl_divergence=self.kl[0],
                                    kl_beta=self.kl[1])
            yield built, plan.unaligned

    @contextmanager
    def targets(self, batch: Batch) -> Iterator[Aligned]:
        with self.built(batch) as (built, unaligned):
            self.kd_spans, self.kd_spans_dropped = self.kd_spans + built.spans, self.kd_spans_dropped + built.dropped
            self.tokens_unaligned += sum(unaligned)
            yield built.targets


__all__ = ["CrossTargets", "CrossTokenizerTeacher", "aligned_targets", "rows_of", "vocab_map_of"]
