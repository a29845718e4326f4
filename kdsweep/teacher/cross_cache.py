"""The teacher-logit cache of a teacher with another tokenizer: its targets kept on the student's positions.

A live cross-tokenizer teacher (:class:`~kdsweep.teacher.cross.CrossTokenizerTeacher`) gives each micro-batch an
:class:`~kdsweep.losses.aligned.Aligned`: per aligned span, the teacher's logits predicting its first teacher token
and the log-probability of its later ones. The cache keeps exactly that at each span's head position (the fields of
an ``aligned`` :class:`~kdsweep.teacher.cache.Spec`), so a trial reads it back without the teacher, its tokenizer's
reading of the rows or the alignment: the student's side of a span (its continuation positions and their tokens)
is the head, the span's length and the row's labels. The continuation is kept at the loss's temperature and at 1
(the logged distance's), where the live teacher can give any; the first token's logits are exact at any.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

from kdsweep.data.batch import Batch
from kdsweep.losses.aligned import Aligned, KeptSpans
from kdsweep.teacher.build import DTYPES, RowFields
from kdsweep.teacher.cache import Spec
from kdsweep.teacher.cached import CachedSplit, ReadAhead
from kdsweep.teacher.cross import CrossTargets, CrossTokenizerTeacher
from kdsweep.teacher.source import TeacherSource


def span_fields(built: CrossTargets, unaligned: list[int], rows: int, length: int, spec: Spec) -> dict[str, torch.Tensor]:
    """A batch's targets as the cache's fields, field → ``[rows, length, width]`` (on the CPU)."""
    t, n = built.targets, rows * length
    head = t.head.cpu()
    out = {"logits": torch.zeros(n, spec.vocab, dtype=DTYPES[spec.dtype]),
           "span": torch.full((n, 1), -1, dtype=torch.int32),
           "cont_logp": torch.zeros(n, 2), "nll": torch.zeros(n, 1),
           "row_counts": torch.zeros(rows, length, 2, dtype=torch.int32)}
    out["logits"][head] = t.teacher.head_logits().cpu().to(out["logits"].dtype)
    out["span"][head, 0] = torch.tensor([last - first for first, last in t.extent], dtype=torch.int32)
    for column, temperature in enumerate((spec.temperature, 1.0)):
        out["cont_logp"][head, column] = t.teacher.cont_logp(temperature).float().cpu()
    out["nll"][head, 0] = t.teacher.nll().float().cpu()
    out["row_counts"][:, 0, 0] = torch.tensor(built.row_dropped, dtype=torch.int32)
    out["row_counts"][:, 0, 1] = torch.tensor(unaligned, dtype=torch.int32)
    return {k: v.reshape(rows, length, -1) for k, v in out.items()}


class SpanTargets:
    """What a cross-tokenizer teacher gives its cache (a :data:`~kdsweep.teacher.build.Producer`)."""

    def __init__(self, source: CrossTokenizerTeacher, spec: Spec) -> None:
        self.source, self.spec = source, spec

    def __call__(self, batch: Batch, split: str) -> tuple[RowFields, int]:
        before = self.source.tokens_computed
        with self.source.built(batch, split) as (built, unaligned):
            fields = span_fields(built, unaligned, *batch.input_ids.shape, self.spec)
        return (lambda r, index, length: {k: v[r, :length] for k, v in fields.items()}), \
            self.source.tokens_computed - before


class CachedCrossTeacher(TeacherSource):
    """A cross-tokenizer teacher's targets read from its cache (a :class:`~kdsweep.teacher.TeacherSource`);
    ``scoring``: how the spans are scored (:class:`Aligned`'s settings: ``student_vocab``, ``loss``, ``vocab_map``,
    the GOLD weights and the logged divergence). The fields but the head logits of the batches it is told come next
    are read ahead (:class:`~kdsweep.teacher.cached.ReadAhead`); the head logits, one chunk's at a time."""

    def __init__(self, split: CachedSplit, device: torch.device, scoring: dict[str, Any]) -> None:
        self.split, self.device, self.scoring = split, device, scoring
        self.tokens_computed, self.tokens_read = 0, 0
        self.kd_spans, self.kd_spans_dropped, self.tokens_unaligned = 0, 0, 0
        fields = tuple(name for name in split.spec.fields() if name != "logits")
        self.ahead = ReadAhead(lambda batch: split.gather(batch.rows, batch.input_ids.shape[1], fields))

    def prefetch(self, batches: Sequence[Batch]) -> None:
        self.ahead.expect(batches)

    @contextmanager
    def targets(self, batch: Batch) -> Iterator[Aligned]:
        if batch.rows is None:
            raise ValueError("a cached teacher needs batches made by Rows.batch (they carry their row indices)")
        self.tokens_read += batch.input_ids.numel()
        rows, length = batch.rows, batch.input_ids.shape[1]
        targets, dropped, unaligned = from_fields(
            self.ahead.get(batch), batch.labels, self.split.spec, self.scoring, self.device,
            lambda cells: self.split.gather_at(rows, length, "logits", cells).to(self.device, non_blocking=True))
        self.kd_spans += len(targets.extent)
        self.kd_spans_dropped += dropped
        self.tokens_unaligned += unaligned
        yield targets


def from_fields(raw: dict[str, torch.Tensor], labels: torch.Tensor, spec: Spec, scoring: dict[str, Any],
                device: torch.device, logits_at: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Aligned, int, int]:
    """The targets of a batch whose ``labels`` are ``[B, T]`` from its cached fields (field → ``[B, T, width]``,
    :func:`span_fields`, but the logits), and the spans its rows could not train and their tokens in no span.
    ``logits_at(cells)``: the kept logits ``[len(cells), Vt]`` at the batch's flattened cells, on ``device``: read
    one chunk's span heads at a time, so no ``[B·T, Vt]`` tensor is read."""
    span = raw["span"].reshape(-1).long()
    head = (span >= 0).nonzero().squeeze(-1)
    width = span[head]
    owner = torch.repeat_interleave(torch.arange(len(head)), width)  # each continuation position's span
    cont = head[owner] + 1 + torch.arange(len(owner)) - (width.cumsum(0) - width)[owner]
    cont_logp = raw["cont_logp"].reshape(-1, 2)[head]
    move = lambda t: t.to(device, non_blocking=True)
    kept = {spec.temperature: move(cont_logp[:, 0]), 1.0: move(cont_logp[:, 1])}
    targets = Aligned(
        n=span.numel(), head=move(head), cont=move(cont), cont_span=move(owner),
        cont_token=labels.reshape(-1)[move(cont)],
        teacher=KeptSpans(logits_at, head, kept, move(raw["nll"].reshape(-1)[head])),
        extent=list(zip(head.tolist(), (head + width).tolist())), **scoring,
    )
    dropped, unaligned = raw["row_counts"].reshape(-1, 2).sum(0).tolist()
    return targets, dropped, unaligned


__all__ = ["CachedCrossTeacher", "SpanTargets", "from_fields", "span_fields"]
