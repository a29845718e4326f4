"""A cross-tokenizer teacher's targets, on the student's positions (one more kind of :mod:`kdsweep.losses.targets`).

The teacher read the same content in its own tokens; :mod:`kdsweep.teacher.align` grouped both sides into spans.
Each span's KD term sits at one student position, its **head**: the position that predicts the span's first student
token. The student positions predicting the span's later tokens are its **continuation**, and so are the teacher
rows that predict the span's later teacher tokens. :meth:`Aligned.divergence` merges each side's distribution
over the span (:func:`~kdsweep.losses.cross_tokenizer.merge`) from the student's log-probs of the chunk and the
teacher's logits kept here, and scores them with GOLD or ULD; every other position gets 0. Chunks never cut a span
(:meth:`Aligned.cuts`), so a chunked loss is the unchunked one up to summation order.

Tensors: ``head`` ``[S]`` student positions; ``cont`` ``[M]`` student positions, ``cont_span`` ``[M]`` their spans and
``cont_token`` ``[M]`` the tokens they predict; ``teacher`` the teacher's side of each span (:class:`TeacherSpans`):
the distribution of its first teacher token, the log-probability of its later ones and its −log p of all of them,
from a live teacher's rows (:class:`LiveSpans`: kept logits, or hidden states projected one chunk at a time) or from
what a teacher-logit cache kept (:class:`KeptSpans`: logits, or a sparse form: :func:`kept_distribution`).
Continuation rows are in span order. ``extent`` and the continuation counts are host-side, so that :meth:`cuts` and
:meth:`split` need no device sync.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from kdsweep.losses.cross_tokenizer import VocabMap, gold, merge, uld, uld_scale
from kdsweep.losses.divergences import USES_BETA, log_probs, token_log_probs, upcast
from kdsweep.losses import blocks
from kdsweep.losses.targets import cuts_avoiding


class TeacherSpans(Protocol):
    """The teacher's side of each span: the logits predicting its first teacher token, the log-probability of its
    later ones, and its −log p of all of them."""

    def head_log_probs(self, temperature: float) -> torch.Tensor:
        """``[S, Vt]`` the log-probabilities at ``temperature`` of each span's first teacher token."""
        ...

    def cont_logp(self, temperature: float) -> torch.Tensor:
        """``[S]`` the log-probability of each span's later teacher tokens at ``temperature`` (0 for one token)."""
        ...

    def nll(self) -> torch.Tensor:
        """``[S]`` −log p of each span's teacher tokens at T = 1."""
        ...

    def select(self, first: int, count: int) -> "TeacherSpans":
        """Spans ``first`` … ``first + count − 1``."""
        ...


@dataclass
class LiveSpans:
    """A live teacher's: ``rows(index)`` gives the logits ``[len(index), Vt]`` at its flattened positions ``index``
    (its kept logits' rows, or its final hidden states' rows projected by its output layer: the fused loss's, so no
    ``[positions, Vt]`` tensor exists). Per span, ``head_row`` predicts its first teacher token ``head_token``; the
    rows ``cont_row`` ``[Mt]`` predict its later ones ``cont_token``, of spans ``cont_span`` (in span order; ``count``
    per span, host-side). A span's rows are made into logits once, when first asked for (so one chunk's at a time)."""

    rows: Callable[[torch.Tensor], torch.Tensor]
    head_row: torch.Tensor
    head_token: torch.Tensor
    cont_row: torch.Tensor
    cont_token: torch.Tensor
    cont_span: torch.Tensor
    count: list[int]
    _logits: list[torch.Tensor] = field(default_factory=list, repr=False)

    def _all(self) -> torch.Tensor:
        if not self._logits:
            with torch.no_grad():
                self._logits.append(self.rows(torch.cat([self.head_row, self.cont_row])))
        return self._logits[0]

    def head_logits(self) -> torch.Tensor:
        return self._all()[: len(self.head_row)]

    def head_log_probs(self, temperature: float) -> torch.Tensor:
        return log_probs(self.head_logits(), temperature)

    def cont_logp(self, temperature: float) -> torch.Tensor:
        lp = token_log_probs(self._all()[len(self.head_row):], self.cont_token, temperature)
        return lp.new_zeros(len(self.head_row)).index_add(0, self.cont_span, lp)

    def nll(self) -> torch.Tensor:
        # on a copy: the logits it makes go with it (this chunk lives as long as its batch's list of chunks)
        rows = self.select(0, len(self.head_row))
        return -(token_log_probs(rows.head_logits(), rows.head_token) + rows.cont_logp(1.0))

    @functools.cached_property
    def _count_at(self) -> list[int]:
        return list(itertools.accumulate(self.count, initial=0))

    def select(self, first: int, count: int) -> "LiveSpans":
        lo, hi = self._count_at[first], self._count_at[first + count]
        spans = slice(first, first + count)
        return LiveSpans(self.rows, self.head_row[spans], self.head_token[spans], self.cont_row[lo:hi],
                         self.cont_token[lo:hi], self.cont_span[lo:hi] - first, self.count[spans])


@dataclass
class KeptSpans:
    """A teacher-logit cache's: ``read(cells)`` gives what it kept of the head distribution at the student positions
    ``cells`` ``[S]`` (host-side; read one chunk's spans at a time, when first asked for): logits ``[len(cells), Vt]``
    when ``head_temperature`` is None (``full``: any temperature), else log-probabilities at ``head_temperature``
    rebuilt from a sparse form (:func:`kept_distribution`); the continuation's log-probabilities
    ``by_temperature[T]`` ``[S]`` at each temperature it kept (the loss's and 1), and ``t_nll`` ``[S]``."""

    read: Callable[[torch.Tensor], torch.Tensor]
    cells: torch.Tensor
    by_temperature: dict[float, torch.Tensor]
    t_nll: torch.Tensor
    head_temperature: float | None = None
    _rows: list[torch.Tensor] = field(default_factory=list, repr=False)

    def head_log_probs(self, temperature: float) -> torch.Tensor:
        if not self._rows:
            self._rows.append(self.read(self.cells))
        if self.head_temperature is None:
            return log_probs(self._rows[0], temperature)
        if temperature != self.head_temperature:
            raise ValueError(f"the teacher cache kept each span's head distribution at T={self.head_temperature:g}, "
                             f"not at T={temperature:g}")
        return self._rows[0]

    def cont_logp(self, temperature: float) -> torch.Tensor:
        if temperature not in self.by_temperature:
            raise ValueError(f"the teacher cache kept each span's continuation at T={sorted(self.by_temperature)}, "
                             f"not at T={temperature:g}")
        return self.by_temperature[temperature]

    def nll(self) -> torch.Tensor:
        return self.t_nll

    def select(self, first: int, count: int) -> "KeptSpans":
        spans = slice(first, first + count)
        return KeptSpans(self.read, self.cells[spans], {t: v[spans] for t, v in self.by_temperature.items()},
                         self.t_nll[spans], self.head_temperature)


def kept_distribution(ids: torch.Tensor, vocab: int, logp: torch.Tensor | None = None,
                      tail_logp: torch.Tensor | None = None) -> torch.Tensor:
    """``[S, vocab]`` log-probabilities rebuilt from a sparse cache's ``ids`` ``[S, k]``: ``topk`` (``logp`` ``[S, k]``
    their log-probabilities, ``tail_logp`` ``[S]`` the rest's mass, spread evenly over the tokens not listed: exact
    when the tail is empty or one token), or ``sample`` (``ids`` k draws, each weighing 1/k: the empirical
    distribution, a plug-in estimate). fp32, renormalised (what storage rounded); −inf where p = 0."""
    ids = ids.long()
    if logp is None:
        counts = torch.zeros(ids.shape[0], vocab, device=ids.device).scatter_add_(
            -1, ids, torch.full(ids.shape, 1.0 / ids.shape[-1], device=ids.device))
        return counts.log()
    rest = vocab - ids.shape[-1]
    spread = upcast(tail_logp).unsqueeze(-1) - math.log(max(rest, 1))
    out = spread.expand(ids.shape[0], vocab).clone() if rest else torch.full((ids.shape[0], vocab), -math.inf,
                                                                            device=ids.device)
    return F.log_softmax(out.scatter(-1, ids, upcast(logp)), dim=-1)


@dataclass
class Aligned:
    n: int
    head: torch.Tensor
    cont: torch.Tensor
    cont_span: torch.Tensor
    cont_token: torch.Tensor
    """``[M]`` the student token each continuation position predicts (its label)."""
    teacher: TeacherSpans
    extent: list[tuple[int, int]]
    """Per span, ``(head, last)``: the student positions it covers, ``head`` … ``last`` (host-side)."""
    student_vocab: int
    loss: str = "gold"
    """``gold`` or ``uld`` (``loss.cross_tokenizer``)."""
    vocab_map: VocabMap | None = None
    """The tokens both vocabularies share (``gold``)."""
    w_matched: float | None = None
    w_unmatched: float | None = None
    kl_divergence: str = "forward_kl"
    """The divergence of the logged distance (the loss's own, at T = 1)."""
    kl_beta: float = 0.5
    kl_temperature: float = 1.0
    """The temperature of the logged distance: 1, or a sparse cache's (it kept the head distribution at one)."""
    exact: bool = True
    """False for a sparse cache's targets (top k and a tail spread evenly, or draws)."""
    measured = True
    picks = None

    def __len__(self) -> int:
        return self.n

    @property
    def vocab(self) -> int:
        """The student's vocabulary: it is never cut to the teacher's (another vocabulary, not a padded one)."""
        return self.student_vocab

    # -- chunks ------------------------------------------------------------------------------------------------
    def cuts(self, num_chunks: int) -> list[int]:
        """The even split's boundaries, each moved past the span it would cut (a chunk may be left empty)."""
        return cuts_avoiding(self.n, num_chunks, self.extent)

    def split(self, num_chunks: int) -> list["Aligned"]:
        return self.split_at(self.cuts(num_chunks))

    def split_at(self, sizes: list[int]) -> list["Aligned"]:
        """Chunks of these lengths, whose boundaries cut no span."""
        heads = [h for h, _ in self.extent]
        cont_at = list(itertools.accumulate(self.cont_count, initial=0))
        out, lo, first = [], 0, 0
        for size in sizes:
            end = bisect.bisect_left(heads, lo + size, lo=first)  # the spans whose heads are in this chunk
            out.append(self._select(first, end - first, lo, size, cont_at))
            lo, first = lo + size, end
        return out

    def _select(self, first: int, count: int, lo: int, size: int, cont_at: list[int]) -> "Aligned":
        """Spans ``first`` … ``first + count − 1`` on positions ``lo`` … ``lo + size − 1``, renumbered from 0. Each
        side's continuation rows are in span order, so theirs are one slice (``cont_at``: where each span's begin,
        host-side, no device sync)."""
        s_lo, s_hi = cont_at[first], cont_at[first + count]
        spans = slice(first, first + count)
        return replace(
            self, n=size, head=self.head[spans] - lo, cont=self.cont[s_lo:s_hi] - lo,
            cont_span=self.cont_span[s_lo:s_hi] - first, cont_token=self.cont_token[s_lo:s_hi],
            teacher=self.teacher.select(first, count),
            extent=[(h - lo, e - lo) for h, e in self.extent[spans]],
        )

    @property
    def cont_count(self) -> list[int]:
        """Per span, its student continuation positions (``head + 1`` … ``last``)."""
        return [last - head for head, last in self.extent]

    # -- the loss ----------------------------------------------------------------------------------------------
    def _score(self, log_q: torch.Tensor, divergence: str, beta: float, temperature: float) -> torch.Tensor:
        """Each span's term at its head position from the student's ``log_q``, a block of spans at a time
        (:mod:`~kdsweep.losses.blocks`): both sides' merged distributions, the teacher's at ``temperature``."""
        scale = uld_scale(divergence, temperature)  # the loss's factor is the divergence's; ULD's part carries T

        def score(first: int, count: int, rows: torch.Tensor, c_s: torch.Tensor) -> torch.Tensor:
            teacher = self.teacher.select(first, count)
            q = merge(rows, c_s)
            p = merge(teacher.head_log_probs(temperature), teacher.cont_logp(temperature))
            if self.loss == "uld":
                return scale * uld(q, p)
            return gold(q, p, self.vocab_map, divergence, beta, self.w_matched, self.w_unmatched, scale)

        vocab = max(log_q.shape[-1], self.vocab_map.teacher_vocab if self.vocab_map is not None else 0)
        cont_at = list(itertools.accumulate(self.cont_count, initial=0))
        per_span = blocks.block_scores(log_q, self.head, self.cont, self.cont_token, self.cont_span, cont_at, vocab,
                                       score, blocks.SPAN_BLOCK_ELEMENTS)
        return log_q.new_zeros(self.n, dtype=per_span.dtype).index_put((self.head,), per_span)

    def divergence(self, log_q: torch.Tensor, divergence: str, beta: float, temperature: float) -> torch.Tensor:
        """``[n]`` each span's GOLD or ULD term at its head position (0 elsewhere), from the student's log-probs at
        ``temperature`` ``[n, Vs]``."""
        return self._score(log_q, divergence, beta, temperature)

    def kl(self, log_q: torch.Tensor) -> torch.Tensor:
        """``[n]`` the loss's own distance at :attr:`kl_temperature` (there is no KL between two vocabularies)."""
        return self._score(log_q, self.kl_divergence, self.kl_beta, self.kl_temperature)

    def kl_is(self, divergence: str, beta: float, temperature: float) -> bool:
        """True when the loss's divergence, β (where it has one) and temperature are the logged distance's: a GOLD
        or ULD term, sorts included, is then computed once per chunk, not twice."""
        return ((divergence, temperature) == (self.kl_divergence, self.kl_temperature)
                and (beta == self.kl_beta or divergence not in USES_BETA))

    def teacher_ce(self, labels: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
        """``[n]`` the teacher's −log p of each span's own tokens at its head (0 elsewhere): summed over the student's
        tokens, its cross-entropy on the same text as the student's, per student token."""
        t_nll = self.teacher.nll()
        return t_nll.new_zeros(self.n).index_put((self.head,), t_nll)


__all__ = ["Aligned", "KeptSpans", "LiveSpans", "TeacherSpans", "kept_distribution"]
