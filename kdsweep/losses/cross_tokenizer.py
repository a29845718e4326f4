"""Cross-tokenizer KD terms on aligned spans (GOLD and ULD): pure tensor math, imports only torch.

When the teacher's tokenizer is not the student's, the two token sequences of a sample are grouped into spans
that cover the same characters (:mod:`kdsweep.teacher.align`). Each span gets one KD term, comparing the two
models' **merged** distributions for it. A span whose first token is predicted by the distribution ``p`` (at the
position before it) and whose later tokens x₂…x_k the model gives the log-probability ``c = Σ log p_{j−1}(x_j)``
(its continuation; 0 for a one-token span) is, over V + 1 outcomes,

    p̃(y) = p(y)·e^c   for every token y        p̃(rest) = 1 − e^c

— GOLD's merge of the probabilities inside a span (the first position's distribution times the probability of
the span's later tokens), with the continuation read from the positions that predict those tokens, and the mass
it leaves out kept as one more outcome so that p̃ is a distribution (a one-token span: p̃ = p, rest = 0).

- :func:`uld`: Universal Logit Distillation (Boizard et al. 2024), the closed-form optimal-transport distance
  between the two merged distributions with every outcome at unit distance from the others: Σ_r |p̃↓_r − q̃↓_r| over
  the probabilities sorted in decreasing order, the shorter side padded with zeros. Needs no vocabulary mapping.
- :func:`gold`: tokens both vocabularies share (:class:`VocabMap`, the same string on both sides) take the
  divergence the user chose, between the two distributions coarsened to the shared tokens and one "other"
  outcome (every other token, and rest); the rest take ULD over the outcomes they do not share, sorted. The two
  parts are weighted ``w_matched·D + w_unmatched·ULD``, by default as GOLD does: ``w_matched`` = shared tokens /
  the teacher's vocabulary, ``w_unmatched = 1 − w_matched``. When the two vocabularies are one (every token shared)
  and every span is one token, GOLD is the same-tokenizer divergence exactly.

Temperature: the loss multiplies the KD term by the chosen divergence's factor (T², or T for tvd); ULD, an L1
distance like TVD, carries T instead (:func:`uld_scale` corrects its part; nothing changes at T = 1).

Shapes: merged log-probabilities ``[n, V + 1]`` (the last column is rest) in fp32 or float64; per-span values
``[n]``. Nothing here synchronises with the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kdsweep.losses.divergences import divergence_per_token, finite_teacher, temperature_factor, upcast

CROSS_TOKENIZER_LOSSES = ("gold", "uld")
"""The values of ``loss.cross_tokenizer``."""


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 − e^x)`` for x ≤ 0, accurate near 0 and far below it (−inf at x = 0)."""
    x = x.clamp_max(0.0)
    safe = torch.where(x < 0, x, torch.full_like(x, -1.0))  # both branches are differentiated: none may see 0
    value = torch.where(safe > -math.log(2.0), torch.log(-torch.expm1(safe)), torch.log1p(-torch.exp(safe)))
    return torch.where(x < 0, value, torch.full_like(x, -math.inf))


def merge(log_p: torch.Tensor, continuation: torch.Tensor) -> torch.Tensor:
    """``[n, V]`` log-probs of a span's first token and ``[n]`` its continuation's log-probability →
    ``[n, V + 1]`` the merged distribution's log-probs (the last outcome: rest, ``log(1 − e^c)``)."""
    log_p, c = upcast(log_p), upcast(continuation)
    return torch.cat([log_p + c.unsqueeze(-1), log1mexp(c).unsqueeze(-1)], dim=-1)


def sort_decreasing(x: torch.Tensor, with_order: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` ``[n, V]`` sorted along its last dimension in decreasing order, and the order when asked. On the CPU by
    numpy's vectorised sorts (x86-simd-sort: 13x torch's CPU sort for a value sort, 3x for an order, at [55, 42k]
    fp32), elsewhere by ``torch.sort``. Ties may come in either order: the sorted values are the same."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or x.requires_grad:
        values, order = x.sort(dim=-1, descending=True)
        return values, order if with_order else None
    a = x.numpy()
    if not with_order:
        return torch.from_numpy(np.ascontiguousarray(np.sort(a, axis=-1)[..., ::-1])), None
    order = np.ascontiguousarray(np.argsort(a, axis=-1)[..., ::-1])
    return torch.from_numpy(np.take_along_axis(a, order, axis=-1)), torch.from_numpy(order)


class _SortedL1(torch.autograd.Function):
    """Σ_r |q↓_r − p↓_r| from the student's log-probs and the teacher's probabilities already sorted (no gradient).
    The gradient with respect to ``log q_i`` (the sign at i's rank times q_i) is taken in forward, where the sort's
    order is at hand, so what is kept for backward is that one ``[n, V]`` tensor, not the sort's int64 order, exp's
    output and abs's input (three more)."""

    @staticmethod
    def forward(ctx: Any, log_q: torch.Tensor, p_sorted: torch.Tensor) -> torch.Tensor:
        q_sorted, order = sort_decreasing(log_q.exp(), with_order=True)
        w = min(q_sorted.shape[-1], p_sorted.shape[-1])
        diff = q_sorted[:, :w] - p_sorted[:, :w]
        value = diff.abs().sum(-1) + q_sorted[:, w:].sum(-1) + p_sorted[:, w:].sum(-1)  # the shorter side's zeros
        if ctx.needs_input_grad[0]:
            q_sorted[:, :w] = diff.sign_().mul_(q_sorted[:, :w])  # beyond w: |q − 0|, sign 1
            del diff
            ctx.save_for_backward(torch.empty_like(q_sorted).scatter_(-1, order, q_sorted))
        return value

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (per_log_q,) = ctx.saved_tensors
        return per_log_q * grad.unsqueeze(-1), None


def sorted_probs(log_p: torch.Tensor) -> torch.Tensor:
    """``[n, V]`` the probabilities of log-probs ``log_p`` in decreasing order, without a gradient (the teacher's)."""
    with torch.no_grad():
        return sort_decreasing(log_p.exp())[0]


def sorted_l1(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """``[n]`` Σ_r |q↓_r − p↓_r| between probabilities sorted in decreasing order, the shorter side zero-padded;
    differentiable in ``log_q`` only (``log_p`` is the teacher's)."""
    return _SortedL1.apply(log_q, sorted_probs(log_p))


def uld(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """``[n]`` ULD between the student's merged log-probs ``log_q`` ``[n, Vs + 1]`` and the teacher's
    ``[n, Vt + 1]``."""
    return sorted_l1(upcast(log_q), upcast(log_p))


@dataclass(frozen=True)
class VocabMap:
    """Which student token is which teacher token: ``student[i]`` and ``teacher[i]`` are one string (``[m]`` ids);
    ``student_only`` / ``teacher_only`` the ids each side does not share. Built once per pair
    (:func:`kdsweep.teacher.align.shared_vocab`)."""

    student: torch.Tensor
    teacher: torch.Tensor
    student_only: torch.Tensor
    teacher_only: torch.Tensor
    teacher_vocab: int

    @classmethod
    def of(cls, pairs: list[tuple[int, int]], student_vocab: int, teacher_vocab: int) -> "VocabMap":
        s = torch.tensor([a for a, _ in pairs], dtype=torch.long)
        t = torch.tensor([b for _, b in pairs], dtype=torch.long)
        s_only = torch.ones(student_vocab, dtype=torch.bool)
        t_only = torch.ones(teacher_vocab, dtype=torch.bool)
        s_only[s], t_only[t] = False, False
        return cls(s, t, s_only.nonzero().squeeze(-1), t_only.nonzero().squeeze(-1), teacher_vocab)

    @property
    def matched_share(self) -> float:
        """GOLD's default weight of the matched part: shared tokens / the teacher's vocabulary."""
        return len(self.teacher) / self.teacher_vocab

    def to(self, device: torch.device) -> "VocabMap":
        return VocabMap(self.student.to(device), self.teacher.to(device), self.student_only.to(device),
                        self.teacher_only.to(device), self.teacher_vocab)


def _with_rest(only: torch.Tensor, width: int) -> torch.Tensor:
    """The unshared ids and the rest outcome (the last column of a merged ``[n, width]``)."""
    return torch.cat([only, torch.tensor([width - 1], dtype=only.dtype, device=only.device)])


def gold(log_q: torch.Tensor, log_p: torch.Tensor, vocab: VocabMap, divergence: str = "forward_kl",
         beta: float = 0.5, w_matched: float | None = None, w_unmatched: float | None = None,
         uld_scale: float = 1.0) -> torch.Tensor:
    """``[n]`` GOLD between the student's merged log-probs ``log_q`` ``[n, Vs + 1]`` and the teacher's ``log_p``
    ``[n, Vt + 1]``: ``w_matched``·D(teacher, student) over the shared tokens and one "other" outcome, plus
    ``w_unmatched``·``uld_scale``·ULD over the outcomes neither shares (GOLD's weights when None; ``uld_scale``: see
    :func:`uld_scale`)."""
    log_q, log_p = upcast(log_q), upcast(log_p)
    w_m = vocab.matched_share if w_matched is None else w_matched
    w_u = 1.0 - w_m if w_unmatched is None else w_unmatched
    q_other = log_q[:, _with_rest(vocab.student_only, log_q.shape[-1])]  # gathered once: both parts read them
    p_other = log_p[:, _with_rest(vocab.teacher_only, log_p.shape[-1])]
    coarse_q = torch.cat([log_q[:, vocab.student], q_other.logsumexp(-1, keepdim=True)], dim=-1)
    coarse_p = torch.cat([log_p[:, vocab.teacher], p_other.logsumexp(-1, keepdim=True)], dim=-1)
    # an outcome of no mass on both sides (rest of a one-token span; "other" when every token is shared) gives 0
    matched = divergence_per_token(divergence, finite_teacher(coarse_q), finite_teacher(coarse_p), beta=beta)
    if w_u == 0.0:
        return w_m * matched
    return w_m * matched + w_u * uld_scale * sorted_l1(q_other, p_other)


def uld_scale(divergence: str, temperature: float) -> float:
    """What ULD's part is multiplied by so that, after the loss's temperature factor for ``divergence`` (T², or T
    for tvd), it carries T: ULD is an L1 distance between probabilities, first-order like TVD, whose gradient
    shrinks as 1/T (T² would over-weight it at T > 1). 1 at T = 1."""
    return temperature_factor("tvd", temperature) / temperature_factor(divergence, temperature)


__all__ = ["CROSS_TOKENIZER_LOSSES", "VocabMap", "gold", "log1mexp", "merge", "sort_decreasing", "sorted_l1", "uld",
           "uld_scale"]
