"""Divergences between a teacher and a student distribution: pure functions on log-probabilities.

Shapes: ``log_p_s`` and ``log_p_t`` are ``[N, V]`` fp32 log-probabilities (N tokens, V vocabulary entries) of the
student S and the teacher T; every divergence returns ``[N]``, one value per token, in nats. All are
**zero-based**: identical distributions give 0 (unlike the cross-entropy to the teacher, which adds the
teacher's entropy). :func:`divergence_sum` turns logits and labels into ``(Σ over valid tokens, valid count)``.

=================  ===================================================================  ===========
name               D(T, S) per token                                                    T-factor
=================  ===================================================================  ===========
``forward_kl``     KL(T‖S) = Σ t (log t − log s)                                        T²
``reverse_kl``     KL(S‖T) = Σ s (log s − log t)                                        T²
``jsd``            JSD(β) = β·KL(T‖M) + (1−β)·KL(S‖M),  M = β·T + (1−β)·S               T²
``jsd_normalized`` JSD(β) / (β(1−β));  = forward_kl at β=0, = reverse_kl at β=1          T²
``tvd``            TVD = ½ Σ |t − s|                                                    T
``symmetric``      (1−β)·KL(T‖S) + β·KL(S‖T)                                            T²
=================  ===================================================================  ===========

**β.** One meaning wherever it interpolates between the two KLs: β = 0 is the forward-KL end, β = 1 the
reverse-KL end. In ``jsd`` β is the teacher's weight in the mixture M (so JSD(0) = JSD(1) = 0, and JSD(½) is the
classic Jensen-Shannon divergence, symmetric and at most log 2). ``jsd_normalized`` divides by β(1−β), which
tends to KL(T‖S) as β → 0 and to KL(S‖T) as β → 1; it is defined at β = 0 and β = 1 by those limits, so a β
sweep has no jump at its ends. ``symmetric`` weighs reverse KL by β (β = ½: half the Jeffreys divergence).
Near S = T every smooth divergence here is ≈ c·½χ² with c = 1, except ``jsd`` (c = β(1−β)).

**Temperature.** Both distributions are ``softmax(logits / T)``. The KD term is multiplied by
:func:`temperature_factor` so that the size of its gradient with respect to the student logits does not change
with T (Hinton et al. 2015), which keeps kd_ratio and the learning rate meaningful across a temperature
sweep. The smooth divergences (both KLs, both JSDs, symmetric) are second order in the logit difference Δz at
high T: D ≈ Σ (Δp)²/p with Δp ∝ Δz/T, so D and its gradient shrink as 1/T² and get T². TVD is first order:
Σ|Δp| ∝ 1/T and its gradient (a sign times ∂p/∂z ∝ 1/T) shrinks as 1/T, so it gets T; T² would make it grow
linearly with T. At T = 1 all factors are 1.

**Numerics.** Inputs are cast to fp32 (float64 stays float64). log M is never formed as ``log(β·t + (1−β)·s)``:
the JSDs use ``log M − log S = logaddexp(log β + (log t − log s), log(1−β))`` (as a softplus) and the mirror
image for ``log M − log T``, which keep the relative difference accurate when M is close to S or T (β near 0
or 1): the normalised JSD then stays within fp32 rounding of the float64 value instead of dividing cancellation
error by β (measured: ≤ 2e-5 relative per token at β = 1e-8 … 1 − 1e-8; a naive log M is 3% off at β = 1e-4).
Teacher log-probabilities of −inf (a token the teacher rules out) are allowed: forward KL, both JSDs and TVD
stay finite with finite gradients; reverse KL and ``symmetric`` are then (correctly) enormous. Student logits
must be finite. Nothing here synchronises with the host.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

DIVERGENCES: tuple[str, ...] = ("forward_kl", "reverse_kl", "jsd", "jsd_normalized", "tvd", "symmetric")
"""Every divergence name :func:`divergence_per_token` accepts (the values of ``loss.divergence``)."""

USES_BETA = frozenset({"jsd", "jsd_normalized", "symmetric"})
"""The divergences whose value depends on ``loss.beta``."""
_FIRST_ORDER = frozenset({"tvd"})


def log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[..., V]`` → ``[..., V]`` fp32 ``log_softmax(logits / T)``.

    Also right for log-probabilities (at T = 1) given instead of logits: log-softmax is shift-invariant, so
    ``log_softmax(log p / T)`` is the tempered distribution, renormalised in fp32 (which a cut vocabulary needs).
    """
    return F.log_softmax(_tempered(logits, temperature), dim=-1)


class _LogProbsOnce(torch.autograd.Function):
    """The student's log-probabilities at T (and, given labels, its CE at T = 1 from them; given ``picks`` ``[n, k]``,
    the log-probs at those ids), for a graph differentiated once (a training step's): the backward writes the whole
    gradient with respect to the logits into the log-probabilities' own memory, ``g − p·(Σg − c) − c·onehot(label)``
    (g the gradient reaching the log-probs, the picked ones' scattered in; c the CE's weight on valid rows), so no
    other ``[n, V]`` tensor exists for it: torch's log-softmax backward allocates one, the CE's ``nll_loss`` backward
    another, a gather's backward a zero-filled third, and their sum a fourth. A divergence that reads only the
    picked log-probs (a sampled cache's) sends no ``[n, V]`` gradient at all. A second backward raises torch's
    in-place error."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, temperature: float, labels: torch.Tensor | None,
                ignore_index: int, picks: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        out = F.log_softmax(_tempered(logits, temperature), dim=-1)
        ce = out.new_zeros(())
        at = valid = None
        if labels is not None:
            valid = labels != ignore_index
            at = torch.where(valid, labels, 0).unsqueeze(-1)
            ce = -torch.where(valid, out.gather(-1, at).squeeze(-1), 0.0).sum()
        picked = out.gather(-1, picks) if picks is not None else None
        ctx.save_for_backward(out, at, valid, picks)
        ctx.temperature, ctx.dtype = temperature, logits.dtype
        ctx.set_materialize_grads(False)
        return out, ce, picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None, grad_ce: torch.Tensor | None,
                 grad_picked: torch.Tensor | None) -> tuple[Any, ...]:
        out, at, valid, picks = ctx.saved_tensors
        c = None
        if grad_ce is not None and at is not None:
            c = torch.where(valid, grad_ce, 0.0).to(out.dtype).unsqueeze(-1)  # [n, 1]
        if grad is None and c is None and grad_picked is None:
            return None, None, None, None, None
        coef = grad.sum(-1, keepdim=True) if grad is not None else out.new_zeros(out.shape[0], 1)
        if grad_picked is not None:
            coef = coef + grad_picked.sum(-1, keepdim=True)
        if c is not None:
            coef = coef - c
        grad_in = out.exp_().mul_(coef.neg_())  # −p·(Σg − c), in the log-probs' memory
        if grad is not None:
            grad_in.add_(grad)
        if grad_picked is not None:
            grad_in.scatter_add_(-1, picks, grad_picked.to(out.dtype))
        if c is not None:
            grad_in.scatter_add_(-1, at, -c)
        if ctx.temperature != 1.0:
            grad_in.div_(ctx.temperature)
        return grad_in.to(ctx.dtype), None, None, None, None


def student_log_probs(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                      ignore_index: int = -100, once: bool = False,
                      picks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``([n, V] log_softmax(logits / T), Σ over valid tokens of the CE at T = 1, [n, k] the log-probs at picks)`` of
    the student's logits ``[n, V]`` and labels ``[n]`` (None for the picked ones without ``picks`` ``[n, k]`` int64);
    ``once``: the graph is differentiated once (a training step's), so the backward needs no ``[n, V]`` tensor beyond
    the log-probabilities' own (:class:`_LogProbsOnce`)."""
    if once and logits.requires_grad and torch.is_grad_enabled():
        log_q, ce, picked = _LogProbsOnce.apply(logits, temperature, labels if temperature == 1.0 else None,
                                                ignore_index, picks)
    else:  # the tempered log-probs are the T=1 ones at T=1: reused for CE
        log_q = log_probs(logits, temperature)
        ce = F.nll_loss(log_q, labels, ignore_index=ignore_index, reduction="sum") if temperature == 1.0 else None
        picked = log_q.gather(-1, picks) if picks is not None else None
    if temperature != 1.0:  # the CE is at T = 1
        ce = F.cross_entropy(upcast(logits), labels, ignore_index=ignore_index, reduction="sum")
    return log_q, ce, picked


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    x = upcast(logits)
    return x / temperature if temperature != 1.0 else x


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[...]`` fp32 ``log_softmax(logits / T)`` at ``tokens`` ``[...]`` alone: the token's logit less the logsumexp,
    without the ``[..., V]`` log-probabilities a full log-softmax would write."""
    x = _tempered(logits, temperature)
    return x.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1) - x.logsumexp(-1)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or float64 if it already is (so float64 checks stay float64)."""
    return x if x.dtype == torch.float64 else x.float()


def finite_teacher(log_p_t: torch.Tensor) -> torch.Tensor:
    """``[..., V]``: −inf teacher log-probs replaced by the smallest fp32 value (p = 0 exactly, no 0·∞ = NaN)."""
    return log_p_t.clamp_min(torch.finfo(log_p_t.dtype).min)


def forward_kl(log_p_s: torch.Tensor, log_p_t: torch.Tensor) -> torch.Tensor:
    """``[N]`` KL(T‖S) = Σ_v t_v (log t_v − log s_v); log-probs ``[N, V]``.

    Mode-covering: the student pays wherever the teacher has mass it lacks.
    """
    return (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1)


def reverse_kl(log_p_s: torch.Tensor, log_p_t: torch.Tensor) -> torch.Tensor:
    """``[N]`` KL(S‖T) = Σ_v s_v (log s_v − log t_v); log-probs ``[N, V]``.

    Mode-seeking: the student pays for mass where the teacher has little.
    """
    return (log_p_s.exp() * (log_p_s - log_p_t)).sum(-1)


def _kl_to_mixture(log_p_s: torch.Tensor, log_p_t: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``([N] KL(T‖M), [N] KL(S‖M))`` with M = β·T + (1−β)·S, for 0 < β < 1; log-probs ``[N, V]``.

    log M − log T = logaddexp(log β, log(1−β) + log s − log t) and
    log M − log S = logaddexp(log β + log t − log s, log(1−β)): each is a small number computed directly when M
    is close to T or S, not a difference of two large logs.
    """
    # logaddexp(a, c) = c + softplus(a − c); softplus is log1p(exp(·)), exact for small arguments.
    log_b, log_1mb = math.log(beta), math.log1p(-beta)
    diff = log_p_t - log_p_s  # log t − log s
    m_minus_t = log_b + F.softplus((log_1mb - log_b) - diff)
    m_minus_s = log_1mb + F.softplus(diff + (log_b - log_1mb))
    kl_t_m = -(log_p_t.exp() * m_minus_t).sum(-1)
    kl_s_m = -(log_p_s.exp() * m_minus_s).sum(-1)
    return kl_t_m, kl_s_m


def jsd(log_p_s: torch.Tensor, log_p_t: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """``[N]`` generalised Jensen-Shannon JSD(β) = β·KL(T‖M) + (1−β)·KL(S‖M), M = β·T + (1−β)·S.

    log-probs ``[N, V]``.

    β ∈ [0, 1] is the teacher's weight in M. Bounded by the entropy of (β, 1−β) (log 2 at β = ½, where it is
    symmetric in T and S); 0 at β = 0 and β = 1.
    """
    _check_beta(beta)
    if beta == 0.0 or beta == 1.0:
        return log_p_s[..., 0] * 0.0 + log_p_t[..., 0] * 0.0  # M is S or T: zero, keeps the graph and the shape
    kl_t_m, kl_s_m = _kl_to_mixture(log_p_s, log_p_t, beta)
    return beta * kl_t_m + (1.0 - beta) * kl_s_m


def jsd_normalized(log_p_s: torch.Tensor, log_p_t: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """``[N]`` JSD(β) / (β(1−β)) = KL(T‖M)/(1−β) + KL(S‖M)/β; log-probs ``[N, V]``.

    Tends to KL(T‖S) (forward) as β → 0 and to KL(S‖T) (reverse) as β → 1, and is defined there by those
    limits. The gap is ≈ β·|KL(T‖S) − χ²(T‖S)/2| near β = 0 (mirrored near 1): tiny for a student close to its
    teacher, larger for far-apart distributions.
    """
    _check_beta(beta)
    if beta == 0.0:
        return forward_kl(log_p_s, log_p_t)
    if beta == 1.0:
        return reverse_kl(log_p_s, log_p_t)
    kl_t_m, kl_s_m = _kl_to_mixture(log_p_s, log_p_t, beta)
    return kl_t_m / (1.0 - beta) + kl_s_m / beta


def total_variation(log_p_s: torch.Tensor, log_p_t: torch.Tensor) -> torch.Tensor:
    """``[N]`` TVD = ½ Σ_v |t_v − s_v| ∈ [0, 1]; log-probs ``[N, V]``."""
    return 0.5 * (log_p_t.exp() - log_p_s.exp()).abs().sum(-1)


def symmetric_kl(log_p_s: torch.Tensor, log_p_t: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """``[N]`` (1−β)·KL(T‖S) + β·KL(S‖T); log-probs ``[N, V]``.

    β = 0 is forward KL and β = 1 reverse KL (the same ends as :func:`jsd_normalized`); β = ½ is half the
    Jeffreys divergence.
    """
    _check_beta(beta)
    if beta == 0.0:
        return forward_kl(log_p_s, log_p_t)
    if beta == 1.0:
        return reverse_kl(log_p_s, log_p_t)
    return (1.0 - beta) * forward_kl(log_p_s, log_p_t) + beta * reverse_kl(log_p_s, log_p_t)


_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "forward_kl": forward_kl,
    "reverse_kl": reverse_kl,
    "jsd": jsd,
    "jsd_normalized": jsd_normalized,
    "tvd": total_variation,
    "symmetric": symmetric_kl,
}


def _check_beta(beta: float) -> None:
    if not 0.0 <= beta <= 1.0:  # also refuses NaN
        raise ValueError(
            f"beta={beta} is outside [0, 1]; pass beta=<value in [0, 1]> (0 = forward-KL end, 1 = reverse-KL end)"
        )


def check_divergence(divergence: str, beta: float = 0.5, temperature: float = 1.0) -> None:
    """Raise a one-line ValueError for an unknown divergence, β outside [0, 1] or a temperature ≤ 0."""
    if divergence not in _FUNCTIONS:
        raise ValueError(f"divergence={divergence!r} is unknown; use one of {', '.join(DIVERGENCES)}")
    _check_beta(beta)
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0; pass temperature=1.0 (or another positive value)")


def divergence_per_token(
    divergence: str, log_p_s: torch.Tensor, log_p_t: torch.Tensor, *, beta: float = 0.5
) -> torch.Tensor:
    """``[N]`` the named divergence (see :data:`DIVERGENCES`) of log-probs ``[N, V]``.

    β is used by jsd, jsd_normalized and symmetric, ignored by the others.
    """
    check_divergence(divergence, beta)
    fn = _FUNCTIONS[divergence]
    return fn(log_p_s, log_p_t, beta) if divergence in USES_BETA else fn(log_p_s, log_p_t)


def temperature_factor(divergence: str, temperature: float) -> float:
    """The factor the KD term carries: T² for the smooth (second-order) divergences, T for ``tvd`` (first order).

    Chosen so that the gradient with respect to the student logits keeps its size as T grows; see the module
    docstring.
    """
    check_divergence(divergence, temperature=temperature)
    return temperature if divergence in _FIRST_ORDER else temperature**2


def divergence_sum(
    student_logits: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor,
    *,
    divergence: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ over valid tokens of D(teacher_T, student_T), valid-token count)``: fp32 and int64 scalars.

    student_logits ``[N, V]``, teacher ``[N, V]`` logits (log-probabilities at T = 1 are logits too: :func:`log_probs`),
    labels ``[N]`` (only ``labels != ignore_index`` is used). Not scaled by :func:`temperature_factor`. Ignored
    tokens contribute exactly 0 (and zero gradient) whatever their logits; all-masked gives (0, 0).
    """
    check_divergence(divergence, beta, temperature)
    log_p_s = log_probs(student_logits, temperature)
    log_p_t = finite_teacher(log_probs(teacher, temperature))
    per_token = divergence_per_token(divergence, log_p_s, log_p_t, beta=beta)
    valid = labels != ignore_index
    return torch.where(valid, per_token, 0.0).sum(), valid.sum()


__all__ = [
    "DIVERGENCES",
    "USES_BETA",
    "check_divergence",
    "divergence_per_token",
    "divergence_sum",
    "finite_teacher",
    "upcast",
    "forward_kl",
    "jsd",
    "jsd_normalized",
    "log_probs",
    "reverse_kl",
    "symmetric_kl",
    "temperature_factor",
    "total_variation",
]
