"""The teacher-logit cache of a teacher with another tokenizer: its targets kept on the student's positions.

A live cross-tokenizer teacher (:class:`~kdsweep.teacher.cross.CrossTokenizerTeacher`) gives each micro-batch an
:class:`~kdsweep.losses.aligned.Aligned`: per aligned span, the teacher's logits predicting its first teacher token
and the log-probability of its later ones. The cache keeps that at each span's head position (the fields of an
``aligned`` :class:`~kdsweep.teacher.cache.Spec`), so a trial reads it back without the teacher, its tokenizer's
reading of the rows or the alignment: the student's side of a span (its continuation positions and their tokens)
is the head, the span's length and the row's labels. The continuation is kept at the loss's temperature and at 1
(the logged distance's), where the live teacher can give any. The first token's distribution: ``full``'s logits
(exact at any temperature), or at the loss's temperature ``topk``'s k most likely tokens and the tail's mass
(spread evenly over the others: exact when the tail is empty or one token; otherwise GOLD's and ULD's terms of a
distribution with the same top k) or ``sample``'s k draws (the empirical distribution: a plug-in estimate, biased
for GOLD's and ULD's sorted part) — about 100 bytes per position at a 152k vocabulary instead of 600 kB.
"""

from __future__ import annotations

import bisect
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

from kdsweep.data.batch import Batch
from kdsweep.losses.aligned import Aligned, KeptSpans, kept_distribution
from kdsweep.losses.blocks import block_rows
from kdsweep.data.sampling import stream_seed
from kdsweep.teacher.build import DTYPES, RowFields, sparse_fields
from kdsweep.teacher.cache import Spec
from kdsweep.teacher.cached import CachedSplit, ReadAhead, signed_bits
from kdsweep.teacher.cross import CrossTargets, CrossTokenizerTeacher
from kdsweep.teacher.source import TeacherSource


def span_blocks(built: CrossTargets, unaligned: list[int], rows: int, length: int, spec: Spec,
                seeds: Sequence[int] = ()) -> RowFields:
    """A batch of ``rows`` rows of ``length`` positions as the cache's fields, a row's positions a block of
    :func:`~kdsweep.losses.blocks.block_rows` at a time (a :data:`~kdsweep.teacher.build.RowFields`, field →
    ``[block, width]`` on the CPU): each block's spans projected alone (:meth:`LiveSpans.select`), so no
    ``[spans, Vt]`` tensor exists. ``seeds``: per row, the seed of its draws (``sample``: a row's draws do not depend
    on its batch; one stream through its blocks)."""
    t = built.targets
    heads = t.head.cpu()
    starts = heads.tolist()
    widths = torch.tensor([last - first for first, last in t.extent], dtype=torch.int32)
    block = block_rows(spec.vocab)

    def row(r: int, index: int, row_length: int) -> Iterator[dict[str, torch.Tensor]]:
        generator, base = None, r * length
        for a in range(0, row_length, block):
            b = min(a + block, row_length)
            lo, hi = bisect.bisect_left(starts, base + a), bisect.bisect_left(starts, base + b)
            out = {name: torch.zeros(b - a, width, dtype=DTYPES[dtype])
                   for name, (dtype, width) in spec.fields().items()}
            out["span"][:] = -1
            if a == 0:  # at each row's first position
                out["row_counts"][0] = torch.tensor([built.row_dropped[r], unaligned[r]])
            if hi > lo:
                at, part = heads[lo:hi] - base - a, t.teacher.select(lo, hi - lo)
                if spec.method == "full":
                    out["logits"][at] = part.head_logits().cpu().to(out["logits"].dtype)
                else:
                    logp = part.head_log_probs(spec.temperature).float()
                    if spec.method == "sample" and generator is None:
                        generator = torch.Generator(device=logp.device)
                        generator.manual_seed(seeds[r])
                    for name, values in sparse_fields(logp, spec, generator).items():
                        signed_bits(out[name])[at] = signed_bits(values.cpu())
                out["span"][at, 0] = widths[lo:hi]
                for column, temperature in enumerate((spec.temperature, 1.0)):
                    out["cont_logp"][at, column] = part.cont_logp(temperature).float().cpu()
                out["nll"][at, 0] = part.nll().float().cpu()
            yield out

    return row


def span_fields(built: CrossTargets, unaligned: list[int], rows: int, length: int, spec: Spec,
                seeds: Sequence[int] = ()) -> dict[str, torch.Tensor]:
    """:func:`span_blocks` of a whole batch at once, field → ``[rows, length, width]``."""
    row = span_blocks(built, unaligned, rows, length, spec, seeds)
    blocks = [list(row(r, r, length)) for r in range(rows)]
    return {name: torch.stack([torch.cat([b[name] for b in bs]) for bs in blocks]) for name in spec.fields()}


class SpanTargets:
    """What a cross-tokenizer teacher gives its cache (a :data:`~kdsweep.teacher.build.Producer`)."""

    def __init__(self, source: CrossTokenizerTeacher, spec: Spec) -> None:
        self.source, self.spec = source, spec

    @contextmanager
    def __call__(self, batch: Batch, split: str) -> Iterator[tuple[RowFields, int]]:
        before = self.source.tokens_computed
        seeds = [stream_seed(self.spec.seed, split, int(r)) for r in batch.rows.tolist()]
        with self.source.built(batch, split) as (built, unaligned):
            yield (span_blocks(built, unaligned, *batch.input_ids.shape, self.spec, seeds),
                   self.source.tokens_computed - before)


class CachedCrossTeacher(TeacherSource):
    """A cross-tokenizer teacher's targets read from its cache (a :class:`~kdsweep.teacher.TeacherSource`);
    ``scoring``: how the spans are scored (:class:`Aligned`'s settings: ``student_vocab``, ``loss``, ``vocab_map``,
    the GOLD weights and the logged divergence). The fields of the batches it is told come next are read ahead
    (:class:`~kdsweep.teacher.cached.ReadAhead`), but ``full``'s head logits: those one chunk's at a time."""

    def __init__(self, split: CachedSplit, device: torch.device, scoring: dict[str, Any]) -> None:
        self.split, self.device, self.scoring = split, device, scoring
        self.tokens_computed, self.tokens_read = 0, 0
        self.kd_spans, self.kd_spans_dropped, self.tokens_unaligned = 0, 0, 0
        fields = tuple(name for name in split.spec.fields() if name != "logits")
        self.ahead = ReadAhead(lambda batch: split.gather(batch.rows, batch.input_ids.shape[1], fields),
                               background=device.type == "cuda")

    def prefetch(self, batches: Sequence[Batch]) -> None:
        self.ahead.expect(batches)

    @contextmanager
    def targets(self, batch: Batch) -> Iterator[Aligned]:
        if batch.rows is None:
            raise ValueError("a cached teacher needs batches made by Rows.batch (they carry their row indices)")
        self.tokens_read += batch.input_ids.numel()
        rows, length, spec = batch.rows, batch.input_ids.shape[1], self.split.spec
        raw = self.ahead.get(batch)
        if spec.method == "full":  # each chunk's heads read from the memory map
            head_at = self.split.reader(rows, length, "logits", self.device)
        else:
            head_at = sparse_head(raw, spec, self.device)
        targets, dropped, unaligned = from_fields(raw, batch.labels, spec, self.scoring, self.device, head_at)
        self.kd_spans += len(targets.extent)
        self.kd_spans_dropped += dropped
        self.tokens_unaligned += unaligned
        yield targets


def sparse_head(raw: dict[str, torch.Tensor], spec: Spec,
                device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """A sparse cache's head distributions at the batch's flattened cells (:func:`kept_distribution`), ``[cells, Vt]``
    log-probabilities on ``device``, rebuilt one chunk's spans at a time."""
    flat = {k: raw[k].reshape(-1, raw[k].shape[-1]) for k in ("ids", "logp", "tail_logp") if k in raw}

    def at(cells: torch.Tensor) -> torch.Tensor:
        kept = {k: v[cells].to(torch.int64 if k == "ids" else v.dtype).to(device, non_blocking=True)
                for k, v in flat.items()}
        tail = kept.get("tail_logp")
        return kept_distribution(kept["ids"], spec.vocab, kept.get("logp"), None if tail is None else tail[:, 0])

    return at


def from_fields(raw: dict[str, torch.Tensor], labels: torch.Tensor, spec: Spec, scoring: dict[str, Any],
                device: torch.device, head_at: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Aligned, int, int]:
    """The targets of a batch whose ``labels`` are ``[B, T]`` from its cached fields (field → ``[B, T, width]``,
    :func:`span_fields`, but ``full``'s logits), and the spans its rows could not train and their tokens in no span.
    ``head_at(cells)``: what the cache kept of the head distributions ``[len(cells), Vt]`` at the batch's flattened
    cells, on ``device`` (``full``: logits; sparse: log-probabilities at its temperature): read one chunk's span
    heads at a time, so no ``[B·T, Vt]`` tensor is made."""
    span = raw["span"].reshape(-1).long()
    head = (span >= 0).nonzero().squeeze(-1)
    width = span[head]
    owner = torch.repeat_interleave(torch.arange(len(head)), width)  # each continuation position's span
    cont = head[owner] + 1 + torch.arange(len(owner)) - (width.cumsum(0) - width)[owner]
    cont_logp = raw["cont_logp"].reshape(-1, 2)[head]
    move = lambda t: t.to(device, non_blocking=True)
    kept = {spec.temperature: move(cont_logp[:, 0]), 1.0: move(cont_logp[:, 1])}
    full = spec.method == "full"
    targets = Aligned(
        n=span.numel(), head=move(head), cont=move(cont), cont_span=move(owner),
        cont_token=labels.reshape(-1)[move(cont)],
        teacher=KeptSpans(head_at, head, kept, move(raw["nll"].reshape(-1)[head]),
                          head_temperature=None if full else spec.temperature),
        extent=list(zip(head.tolist(), (head + width).tolist())),
        kl_temperature=1.0 if full else spec.temperature, exact=full, **scoring,
    )
    dropped, unaligned = raw["row_counts"].reshape(-1, 2).sum(0).tolist()
    return targets, dropped, unaligned


__all__ = ["CachedCrossTeacher", "SpanTargets", "from_fields", "sparse_head", "span_blocks", "span_fields"]
