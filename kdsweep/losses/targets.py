"""What the teacher gives the loss for N tokens: its logits, or what a teacher-logit cache kept of them.

Every kind implements :class:`Targets` (the loss and the evaluation depend on that protocol alone), splitting into
token chunks of the lengths its ``cuts`` gives, by which the student's logits are split too
(:func:`~kdsweep.losses.kd.split_like`). Three kinds here; :class:`~kdsweep.losses.aligned.Aligned` (a teacher with
another tokenizer, span by span), :class:`~kdsweep.losses.mixture.Mixture` (several teachers) and
:class:`~kdsweep.teacher.absent.NoTargets` (``kd_ratio=0``'s training steps: no teacher) elsewhere:

- :class:`Logits` — every logit (a live teacher, or ``teacher.cache.method=full``). **Exact**: every divergence,
  at any temperature.
- :class:`Samples` — k tokens drawn with replacement from the teacher's distribution at temperature T_c
  (RS-KD, "Sparse Logit Sampling", Anshumann et al. 2025), plus the teacher's entropy H and the log-probability
  of the gold label. With the empirical distribution p̂ (each draw weighs 1/k), forward KL is estimated as
  KL ≈ −H − Σ_v p̂_v log q_v: since E[p̂] = p, the estimate and its gradient (q − p̂)/T with respect to the student
  logits are **unbiased**. Only forward KL can be estimated this way (the others need the teacher's probability
  wherever the student puts mass), and only at T = T_c (samples drawn at one temperature are not draws at another).
- :class:`TopK` — the k most likely tokens with their log-probabilities at T_c and the rest of the mass as one
  "tail" outcome. Every divergence is computed between the teacher's and the student's distributions
  coarsened to these k + 1 outcomes: **exact when the tail holds no mass, otherwise biased low** (coarsening
  never increases an f-divergence; all divergences here are f-divergences), and its gradient does not see how the
  student spreads the tail's mass. Again only at T = T_c.

Shapes: ``ids``/``logp`` ``[N, k]``; per-token values ``[N]``; log-probabilities fp32 (stored ones may be 16-bit and
are upcast here). Nothing here synchronises with the host.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F

from kdsweep.losses.blocks import row_scores
from kdsweep.losses.divergences import divergence_per_token, finite_teacher, forward_kl, log_probs, upcast

SAMPLED_DIVERGENCES = ("forward_kl",)
"""The divergences the ``sample`` method can estimate without bias."""


class Targets(Protocol):
    """The teacher's targets for N flattened tokens, as the loss (:func:`~kdsweep.losses.kd.kd_loss_sums`, the fused
    loss) and the evaluation use them. Log-probabilities in and out are fp32; nothing synchronises with the host."""

    exact: bool
    """Whether every divergence is computed exactly (False: an estimate or a bound, e.g. a sparse cache's)."""
    measured: bool
    """Whether these come from a teacher (False: :class:`~kdsweep.teacher.absent.NoTargets`, nothing to measure)."""
    kl_temperature: float
    """The temperature of the logged KL (:meth:`kl`)."""
    extent: Sequence[tuple[int, int]]
    """Spans of tokens ``(first, last)`` no chunk boundary may cut (a cross-tokenizer teacher's)."""
    vocab: int
    """The vocabulary the student's logits are compared over (they are cut to it: a padded teacher's rows)."""

    def __len__(self) -> int: ...

    def cuts(self, num_chunks: int) -> list[int]:
        """The token lengths of :meth:`split`'s chunks."""
        ...

    def split(self, num_chunks: int) -> list["Targets"]: ...

    def split_at(self, sizes: list[int]) -> list["Targets"]:
        """Chunks of these token lengths."""
        ...

    picks: torch.Tensor | None
    """``[n, k]`` int64: the only ids whose student log-probs :meth:`divergence` reads (a sampled cache's draws), so
    the loss hands it those alone (:meth:`picked_divergence`) and backward writes no ``[n, V]`` gradient for it; None
    (every other kind): it reads every token's."""

    def divergence(self, log_q: torch.Tensor, divergence: str, beta: float, temperature: float) -> torch.Tensor:
        """``[n]`` D(teacher_T, student_T) from the student's log-probs at T ``[n, V]`` (differentiable in them)."""
        ...

    def picked_divergence(self, picked: torch.Tensor, divergence: str, beta: float, temperature: float) -> torch.Tensor:
        """:meth:`divergence` from the student's log-probs at :attr:`picks` alone ``[n, k]`` (where picks is set)."""
        ...

    def kl(self, log_q: torch.Tensor) -> torch.Tensor:
        """``[n]`` the logged distance to the teacher at :attr:`kl_temperature`."""
        ...

    def kl_is(self, divergence: str, beta: float, temperature: float) -> bool:
        """Whether :meth:`kl` is :meth:`divergence` at these settings (the loss then logs its own value, computed
        once)."""
        ...

    def teacher_ce(self, labels: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
        """``[n]`` the teacher's cross-entropy on the gold labels (0 where ignored)."""
        ...


def chunk_sizes(n: int, num_chunks: int) -> list[int]:
    """The lengths of :func:`~kdsweep.losses.kd.split_chunks`' pieces of ``n`` tokens: ``min(num_chunks, n)`` nearly
    equal parts (at least one), the longer ones first (``torch.tensor_split``'s rule)."""
    k = min(num_chunks, max(n, 1))
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def cuts_avoiding(n: int, num_chunks: int, extents: list[tuple[int, int]]) -> list[int]:
    """The even split's chunk lengths (:func:`chunk_sizes`), each boundary moved past any span ``(first, last)`` of
    ``extents`` it would cut (a chunk may be left empty): each to the first place at or after it that is inside no
    span (no Python per token)."""
    sizes = chunk_sizes(n, num_chunks)
    if not extents:
        return sizes
    span = torch.tensor(extents, dtype=torch.long)
    depth = torch.zeros(n + 2, dtype=torch.long)  # spans open at p: a boundary at p would cut them
    depth.index_add_(0, span[:, 0] + 1, torch.ones(len(span), dtype=torch.long))
    depth.index_add_(0, span[:, 1] + 1, torch.full((len(span),), -1, dtype=torch.long))
    free = (depth.cumsum(0)[: n + 1] == 0).nonzero().squeeze(-1)  # n is always free
    bounds = free[torch.searchsorted(free, torch.tensor(list(itertools.accumulate(sizes))))].tolist()
    return [b - a for a, b in zip([0, *bounds[:-1]], bounds)]


@dataclass
class Logits:
    """Every teacher logit of N tokens: ``logits`` ``[N, Vt]``, or ``hidden`` ``[N, H]`` projected by ``head`` chunk by
    chunk when a chunk is used (the fused loss: no ``[N, Vt]`` tensor ever exists)."""

    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    head: Callable[[torch.Tensor], torch.Tensor] | None = None
    rows: int | None = None
    """The teacher's output rows, with ``hidden``: its vocabulary, known without projecting anything."""
    kl_temperature: float = 1.0
    """The temperature of the logged KL: 1, since logits give the distribution at any temperature."""
    exact = True
    measured = True
    extent = ()
    """Spans of tokens a chunk boundary may not cut: none (:class:`~kdsweep.losses.aligned.Aligned` has some)."""
    picks = None

    def __post_init__(self) -> None:  # any leading shape: tokens are flattened, the last dimension kept
        flat = lambda t: None if t is None else t.reshape(-1, t.shape[-1])
        self.logits, self.hidden = flat(self.logits), flat(self.hidden)

    def __len__(self) -> int:
        return (self.logits if self.logits is not None else self.hidden).shape[0]

    def cuts(self, num_chunks: int) -> list[int]:
        """The token lengths of :meth:`split`'s chunks (the student's logits are split the same way)."""
        return chunk_sizes(len(self), num_chunks)

    def split(self, num_chunks: int) -> list["Logits"]:
        return self.split_at(self.cuts(num_chunks))

    def split_at(self, sizes: list[int]) -> list["Logits"]:
        """Chunks of these token lengths (every kind: a mixture splits its teachers' targets alike)."""
        if self.logits is not None:
            return [Logits(logits=c) for c in torch.split(self.logits, sizes, dim=0)]
        return [Logits(hidden=c, head=self.head, rows=self.rows) for c in torch.split(self.hidden, sizes, dim=0)]

    @property
    def vocab(self) -> int:
        """The teacher's vocabulary (its output rows, padding included)."""
        return self.rows if self.logits is None and self.rows is not None else self.dense(None).shape[-1]

    def dense(self, vocab: int | None) -> torch.Tensor:
        """``[n, vocab]`` logits, the teacher's rows beyond ``vocab`` cut (a padded output layer). Hidden states are
        projected on each call and the logits not kept: a chunk lives as long as its batch's list of chunks (the
        evaluation's does), so kept logits would add up to the batch's whole ``[N, V]``."""
        if self.logits is not None:
            logits = self.logits
        else:
            with torch.no_grad():
                logits = self.head(self.hidden)
        return logits if vocab is None else logits[..., :vocab]

    def _block_log_probs(self, first: int, count: int, vocab: int, temperature: float) -> torch.Tensor:
        """Rows ``first`` … ``first + count − 1`` of the teacher's finite log-probabilities at ``temperature`` over
        ``vocab`` (hidden states: only those rows projected)."""
        with torch.no_grad():
            rows = self.logits[first:first + count] if self.logits is not None else \
                self.head(self.hidden[first:first + count])
            log_p = log_probs(rows[..., :vocab], temperature)
            return log_p.clamp_min_(torch.finfo(log_p.dtype).min)  # finite_teacher, in the fresh tensor's memory

    def divergence(self, log_q: torch.Tensor, divergence: str, beta: float, temperature: float) -> torch.Tensor:
        """``[n]`` D(teacher_T, student_T) from the student's log-probs at T ``[n, V]``, a block of rows at a time
        (:mod:`~kdsweep.losses.blocks`: the teacher's rows and the divergence's terms of one block exist at once)."""
        if self.logits is not None and self.logits.requires_grad and torch.is_grad_enabled():
            raise ValueError("the teacher's logits require grad: the KD loss differentiates the student only "
                             "(compute them under torch.no_grad(), or pass teacher.detach())")
        v = log_q.shape[-1]
        return row_scores(log_q, max(v, self.vocab), lambda first, count, rows: divergence_per_token(
            divergence, rows, self._block_log_probs(first, count, v, temperature), beta=beta))

    def kl(self, log_q: torch.Tensor) -> torch.Tensor:
        """``[n]`` KL(teacher ‖ student) at :attr:`kl_temperature` from the student's log-probs there."""
        v = log_q.shape[-1]
        return row_scores(log_q, max(v, self.vocab), lambda first, count, rows: forward_kl(
            rows, self._block_log_probs(first, count, v, self.kl_temperature)))

    def kl_is(self, divergence: str, beta: float, temperature: float) -> bool:
        return divergence == "forward_kl" and temperature == self.kl_temperature

    def teacher_ce(self, labels: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
        """``[n]`` the teacher's cross-entropy on the gold labels at T = 1 (0 where ignored)."""
        return F.cross_entropy(upcast(self.dense(vocab)), labels, ignore_index=ignore_index, reduction="none")


@dataclass
class _Sparse:
    """Fields shared by the cached sparse kinds; ``temperature`` is T_c, the temperature they were taken at."""

    ids: torch.Tensor
    label_logp: torch.Tensor
    """``[N]`` log p(gold label) at T = 1 (0 where there is no label), so the teacher's CE is exact."""
    temperature: float
    vocab: int
    """The vocabulary the teacher's distribution was normalised over (the smaller of teacher's and student's)."""
    exact = False
    measured = True
    extent = ()
    picks = None

    def __len__(self) -> int:
        return self.ids.shape[0]

    @property
    def kl_temperature(self) -> float:
        return self.temperature

    def cuts(self, num_chunks: int) -> list[int]:
        return chunk_sizes(len(self), num_chunks)

    def split(self, num_chunks: int) -> list["_Sparse"]:
        return self.split_at(self.cuts(num_chunks))

    def split_at(self, sizes: list[int]) -> list["_Sparse"]:
        names = [f.name for f in fields(self) if f.name not in ("temperature", "vocab")]
        pieces = zip(*(torch.split(getattr(self, n), sizes, dim=0) for n in names))
        return [type(self)(**dict(zip(names, parts)), temperature=self.temperature, vocab=self.vocab)
                for parts in pieces]

    def teacher_ce(self, labels: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
        return torch.where(labels != ignore_index, -upcast(self.label_logp), 0.0)

    def kl(self, log_q: torch.Tensor) -> torch.Tensor:
        return self.divergence(log_q, "forward_kl", 0.0, self.temperature)

    def kl_is(self, divergence: str, beta: float, temperature: float) -> bool:
        return divergence == "forward_kl" and temperature == self.temperature


@dataclass
class Samples(_Sparse):
    """k draws per token from the teacher at T_c: ``ids`` ``[N, k]``, ``entropy`` ``[N]`` (the teacher's, at T_c)."""

    entropy: torch.Tensor = None  # type: ignore[assignment]

    @property
    def picks(self) -> torch.Tensor:  # type: ignore[override]
        return self.ids.long()

    def divergence(self, log_q: torch.Tensor, divergence: str, beta: float, temperature: float) -> torch.Tensor:
        """``[n]`` the unbiased estimate −H − (1/k) Σ_i log q(v_i) of KL(teacher ‖ student) at T = T_c."""
        return self.picked_divergence(log_q.gather(-1, self.picks), divergence, beta, temperature)

    def picked_divergence(self, picked: torch.Tensor, divergence: str, beta: float, temperature: float) -> torch.Tensor:
        if divergence not in SAMPLED_DIVERGENCES:
            raise ValueError(f"teacher.cache.method=sample estimates only forward_kl, not {divergence}")
        if temperature != self.temperature:
            raise ValueError(f"samples drawn at T={self.temperature} cannot train at T={temperature}")
        return -upcast(self.entropy) - picked.mean(-1)


@dataclass
class TopK(_Sparse):
    """The k most likely tokens at T_c: ``ids`` ``[N, k]``, ``logp`` ``[N, k]``, and ``tail_logp`` ``[N]`` = log of the
    mass of every other token."""

    logp: torch.Tensor = None  # type: ignore[assignment]
    tail_logp: torch.Tensor = None  # type: ignore[assignment]

    def divergence(self, log_q: torch.Tensor, divergence: str, beta: float, temperature: float) -> torch.Tensor:
        """``[n]`` D between teacher and student coarsened to the k listed tokens and one tail outcome."""
        if temperature != self.temperature:
            raise ValueError(f"top-k log-probs taken at T={self.temperature} cannot train at T={temperature}")
        # a block of rows at a time (kdsweep.losses.blocks): the tail's [rows, V] copy exists for one block
        return row_scores(log_q, log_q.shape[-1], lambda first, count, rows: self._coarse(
            rows, slice(first, first + count), divergence, beta))

    def _coarse(self, log_q: torch.Tensor, rows: slice, divergence: str, beta: float) -> torch.Tensor:
        ids = self.ids[rows].long()
        top_q = log_q.gather(-1, ids)
        # the student's tail: log Σ over every token not listed, computed from its own log-probs (no 1 − Σ cancel)
        tail_q = log_q.scatter(-1, ids, float("-inf")).logsumexp(-1, keepdim=True)
        coarse_q = torch.cat([top_q, tail_q], dim=-1)
        coarse_p = torch.cat([upcast(self.logp[rows]), upcast(self.tail_logp[rows]).unsqueeze(-1)], dim=-1)
        # renormalise what 16-bit storage rounded, and give an empty tail p = 0 exactly
        coarse_p = finite_teacher(F.log_softmax(coarse_p, dim=-1))
        return divergence_per_token(divergence, coarse_q, coarse_p, beta=beta)

