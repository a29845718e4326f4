"""Pure knowledge-distillation math on tensors.

Every function works on flattened tokens: logits ``[N, V]`` (N tokens, V vocabulary entries) and labels ``[N]``.
Losses are **sums** over valid tokens, accumulated in fp32, returned with the valid-token count, so that callers
can normalise by any count they like (the global count of an optimizer step, for correct gradient
accumulation). Labels equal to ``ignore_index`` contribute nothing; an all-masked input gives exactly 0.
No function here synchronises with the host (no ``.item()``, no boolean indexing).
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

import torch
import torch.nn.functional as F

from kdsweep.losses.divergences import (check_divergence, divergence_sum, log_probs, student_log_probs,
                                        temperature_factor, upcast)
from kdsweep.losses.targets import Logits, Targets


class LossSums(NamedTuple):
    """Token sums of one batch. ``kd`` already carries the temperature factor, so ``total`` is a plain mix."""

    ce: torch.Tensor
    """Σ cross-entropy of the student against the labels (fp32 scalar)."""
    kd: torch.Tensor
    """Σ f(T)·D(teacher_T, student_T) for the chosen divergence D, f(T) = T² (T for tvd) (fp32 scalar)."""
    kl: torch.Tensor
    """Σ KL(teacher ‖ student) at temperature 1, detached: the distance to the teacher, for logging."""
    tokens: torch.Tensor
    """Number of valid (non-ignored) tokens (int64 scalar)."""

    def total(self, kd_ratio: float) -> torch.Tensor:
        """``(1 - kd_ratio)·Σce + kd_ratio·Σkd``."""
        return (1.0 - kd_ratio) * self.ce + kd_ratio * self.kd


def split_chunks(num_chunks: int, *tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Split aligned tensors along their first (token) dimension into the same ``num_chunks`` pieces.

    One split function for logits, labels and teacher values, so a chunk of logits always meets the labels of
    the same tokens, whatever ``N % num_chunks`` is.
    """
    n = tensors[0].shape[0]
    if any(t.shape[0] != n for t in tensors):
        raise ValueError(f"split_chunks: tensors disagree on the token dimension: {[t.shape[0] for t in tensors]}")
    pieces = [torch.tensor_split(t, min(num_chunks, max(n, 1)), dim=0) for t in tensors]
    return list(zip(*pieces))


def split_like(targets: Targets, num_chunks: int, *tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Split the student's token tensors into the chunks ``targets.split(num_chunks)`` makes (``targets.cuts``): the
    even split of :func:`split_chunks`, or one that keeps a cross-tokenizer span inside one chunk."""
    return list(zip(*(torch.split(t, targets.cuts(num_chunks), dim=0) for t in tensors)))


def token_chunks(targets: Targets, num_chunks: int, *tensors: torch.Tensor) -> Iterator[tuple[tuple, Targets]]:
    """Each chunk of ``targets.split(num_chunks)`` with the same tokens of ``tensors`` (:func:`split_like`), handed out
    one at a time: nothing here keeps a chunk once the next is asked for, so a chunk, and whatever its targets compute
    and keep, lives only while its consumer holds it (not the whole batch's chunks until the last is done), and
    not a moment longer: a chunk is popped into the yield, so this frame holds no reference to the one the consumer
    works on (a fused chunk's projected ``[chunk, V]`` logits die once its log-probabilities exist)."""
    pieces, parts = split_like(targets, num_chunks, *tensors), targets.split(num_chunks)
    del tensors
    pieces.reverse()
    parts.reverse()
    while parts:
        yield pieces.pop(), parts.pop()


def align_vocab(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut both ``[..., V]`` tensors to the smaller vocabulary.

    Models that share a tokenizer may pad their output layer to different sizes (Qwen2.5-7B: 152064 rows,
    0.5B: 151936, tokenizer: 151665). The padded rows are never a label, so dropping them on both sides keeps
    the distributions comparable. Callers must have checked that the tokenizer fits inside the smaller size.
    """
    v = min(student_logits.shape[-1], teacher_logits.shape[-1])
    return student_logits[..., :v], teacher_logits[..., :v]


def valid_mask(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``[N]`` bool: tokens that count."""
    return labels != ignore_index


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Σ over valid tokens of −log softmax(logits)[label]; logits ``[N, V]``, labels ``[N]``; fp32."""
    return F.cross_entropy(upcast(logits), labels, ignore_index=ignore_index, reduction="sum")


def forward_kl_sum(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Σ over valid tokens of KL(teacher_T ‖ student_T); logits ``[N, V]``, labels ``[N]`` (only the mask is used).

    Zero-based: identical distributions give exactly 0 (unlike the cross-entropy to the teacher, which adds
    the teacher's entropy and so changes with the teacher, not with the student).
    """
    total, _ = divergence_sum(student_logits, teacher_logits, labels, divergence="forward_kl",
                              temperature=temperature, ignore_index=ignore_index)
    return total


def _check_shapes(student_logits: torch.Tensor, teacher: torch.Tensor | Targets, labels: torch.Tensor) -> None:
    leading = tuple(student_logits.shape[:-1])
    if isinstance(teacher, torch.Tensor):
        ok = tuple(teacher.shape[:-1]) == leading
        shape = tuple(teacher.shape)
    else:
        ok, shape = len(teacher) == labels.numel(), f"{type(teacher).__name__} of {len(teacher)} tokens"
    if student_logits.dim() < 2 or not ok or tuple(labels.shape) != leading:
        raise ValueError(
            f"kd_loss_sums: student logits {tuple(student_logits.shape)}, teacher {shape} and labels "
            f"{tuple(labels.shape)} must share their leading (token) shape, with the vocabulary last "
            "(same batch, same sequence length, labels without a vocabulary dimension)"
        )


def kd_loss_sums(
    student_logits: torch.Tensor,
    teacher: torch.Tensor | Targets,
    labels: torch.Tensor,
    *,
    divergence: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    num_chunks: int = 1,
    once: bool = False,
) -> LossSums:
    """CE, the temperature-scaled KD divergence and the logged forward KL, summed over valid tokens in ``num_chunks``
    chunks.

    student_logits ``[..., Vs]``; ``teacher``: logits ``[..., Vt]`` (log-probabilities at T = 1 are logits too: the
    same log-softmax), or the teacher's targets for the flattened tokens (:mod:`kdsweep.losses.targets`: logits,
    or what a teacher-logit cache kept); labels ``[...]`` with the same leading shape. Everything is flattened to
    tokens; the vocabularies are cut to the smaller one (:func:`align_vocab`) and both distributions renormalised
    there in fp32. ``divergence`` is one of :data:`~kdsweep.losses.divergences.DIVERGENCES`, ``beta`` its β (jsd,
    jsd_normalized, symmetric); ``kd = temperature_factor(divergence, T)·Σ D(teacher_T, student_T)`` (T², or T for
    tvd). The logged ``kl`` is KL(teacher ‖ student) at the targets' ``kl_temperature`` (1 for logits). Chunking
    changes neither values nor gradients beyond fp32 summation order. Raises a one-line ValueError for shapes that
    cannot be aligned or a bad divergence, β or temperature.
    """
    _check_shapes(student_logits, teacher, labels)
    check_divergence(divergence, beta, temperature)
    if num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks} must be >= 1")
    factor = temperature_factor(divergence, temperature)
    targets = Logits(logits=teacher.reshape(-1, teacher.shape[-1])) if isinstance(teacher, torch.Tensor) else teacher
    s, y = student_logits.reshape(-1, student_logits.shape[-1]), labels.reshape(-1)
    ce = s.new_zeros((), dtype=torch.float32)
    kd = s.new_zeros((), dtype=torch.float32)
    kl = s.new_zeros((), dtype=torch.float32)
    # Each piece's logits are let go once its log-probabilities exist (no reference is kept here), so the divergence
    # runs beside one [n, V] student tensor, not two, wherever the caller holds no other reference to them.
    chunks = token_chunks(targets, num_chunks, s, y)
    del student_logits, s
    for (s_c, y_c), t_c in chunks:
        s_c = s_c[..., : min(s_c.shape[-1], t_c.vocab)]
        valid = valid_mask(y_c, ignore_index)
        log_p_s, ce_c, picked = student_log_probs(s_c, y_c, temperature=temperature, ignore_index=ignore_index,
                                                  once=once, picks=t_c.picks)
        ce = ce + ce_c
        del s_c
        d = (t_c.divergence(log_p_s, divergence, beta, temperature) if picked is None
             else t_c.picked_divergence(picked, divergence, beta, temperature))
        kd = kd + torch.where(valid, d, 0.0).sum()
        with torch.no_grad():
            if not t_c.measured:  # no teacher (kd_ratio=0's training steps): no distance to it, and none computed
                kl_tok = torch.full_like(d, float("nan"))
            elif t_c.kl_is(divergence, beta, temperature):
                kl_tok = d
            else:  # log_softmax(log p_s(T) · T / T') = log p_s(T'): the logits' own shift does not matter
                at = log_p_s if t_c.kl_temperature == temperature else log_probs(log_p_s * temperature,
                                                                                 t_c.kl_temperature)
                kl_tok = t_c.kl(at)
            kl = kl + torch.where(valid, kl_tok, 0.0).sum()
    tokens = valid_mask(y, ignore_index).sum()
    return LossSums(ce=ce, kd=kd * factor, kl=kl, tokens=tokens)
