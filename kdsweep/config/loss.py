"""The ``loss`` section: cross-entropy, the KD term and how it is computed."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kdsweep.config.base import _check


DIVERGENCES = ("forward_kl",)


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """``loss = (1-kd_ratio)·CE(student, labels) + kd_ratio·f(T)·D(teacher_T, student_T)``, f(T) = T² (T for tvd).

    D is one of :attr:`DIVERGENCES` (kdsweep.losses.divergences documents each formula and the temperature factor).
    """

    DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "jsd_normalized", "tvd", "symmetric")
    """Allowed ``divergence`` values (the same tuple as ``kdsweep.losses.DIVERGENCES``; a test keeps them equal)."""
    IMPLS = ("auto", "dense", "chunked", "fused")
    """Allowed ``impl`` values."""
    CROSS_TOKENIZER = ("gold", "uld")
    """Allowed ``cross_tokenizer`` values (kdsweep.losses.cross_tokenizer.CROSS_TOKENIZER_LOSSES)."""

    kd_ratio: float = 0.5
    """Weight of the distillation term; set from the top-level knob ``kd_ratio``."""
    temperature: float = 1.0
    """Softmax temperature T applied to both teacher and student logits in the KD term."""
    divergence: str = "forward_kl"
    """Divergence D between teacher T and student S: forward_kl KL(T‖S), reverse_kl KL(S‖T), jsd (generalised
    Jensen-Shannon JSD(β)), jsd_normalized JSD(β)/(β(1-β)), tvd (total variation),
    symmetric (1-β)·KL(T‖S) + β·KL(S‖T)."""
    beta: float = 0.5
    """β in [0, 1] of jsd (the teacher's weight in the mixture), jsd_normalized and symmetric (0 = forward-KL end,
    1 = reverse-KL end); unused by the other divergences."""
    impl: str = "auto"
    """How the loss is computed when it does not fit in one chunk (``chunk_mb``). chunked: from the student's full
    logits, the loss in token chunks, each differentiated at once (one chunk's fp32 temporaries at a time, beside the
    logits and their gradient); fused: from the final hidden states, each chunk projected by the output layers and
    differentiated at once, so neither model's B×T×V logits ever exist; dense: one chunk whatever its size. When one
    chunk fits, every impl runs the plain graph (full logits, the whole loss, one backward). Same values and
    gradients (to fp32 rounding) either way. auto: fused, unless the student or a live teacher applies a transform to
    its logits after its output layer (Gemma 2's soft-capping, Cohere's logit scale), which only the logits paths
    can: then chunked. Resolved once before launch (kdsweep.models.check.choose_impl; run.json records the choice); a
    config built in code and never validated trains auto as chunked."""
    chunk_mb: float = 128.0
    """The most MiB one ``[chunk, V]`` fp32 buffer of the loss may take (V: the student's vocabulary): a micro-batch
    of N tokens is split into ceil(N·V·4 B / chunk_mb) token chunks (kdsweep.train.chunks), so memory, not a count,
    decides. 128 keeps 2,048 tokens at Llama-3's 128k vocabulary in 8 chunks, and a small model's whole loss in one
    (the plain graph: no chunk machinery at all). On a GPU with memory to spare a larger value means fewer, larger
    chunks."""
    ignore_index: int = -100
    """Label value excluded from every loss term and token count."""
    cross_tokenizer: str = "gold"
    """The KD term when the teacher's tokenizer is not the student's (read only then; kdsweep.losses.cross_tokenizer):
    both read the same text, grouped into spans of the same characters, one term per span. gold: the divergence
    above over the tokens both vocabularies share (and one outcome for the others), plus ULD over the tokens they
    do not share (GOLD); uld: ULD alone (sorted probabilities, no vocabulary mapping)."""
    gold_matched_weight: float | None = None
    """gold's weight of the shared-token divergence; None (with ``gold_unmatched_weight`` None): GOLD's, the shared
    tokens' share of the teacher's vocabulary."""
    gold_unmatched_weight: float | None = None
    """gold's weight of ULD over the tokens the vocabularies do not share; None: 1 − the matched weight."""

    def chunks_for(self, tokens: int, vocab: int) -> int:
        """The token chunks of a micro-batch of ``tokens`` tokens over a vocabulary of ``vocab`` (the student's output
        rows): ceil(tokens·vocab·4 B / chunk_mb), one for ``impl=dense`` (kdsweep.train.chunks says why)."""
        if self.impl == "dense":
            return 1
        return max(1, math.ceil(tokens * vocab * 4 / (self.chunk_mb * 2**20)))

    def __post_init__(self) -> None:
        _check(
            0.0 <= self.kd_ratio <= 1.0,
            f"loss.kd_ratio={self.kd_ratio} is outside [0, 1]; pass kd_ratio=<value in [0, 1]> "
            "(0 = pure cross-entropy, 1 = pure distillation)",
        )
        _check(
            self.temperature > 0,
            f"loss.temperature={self.temperature} must be > 0; pass loss.temperature=1.0 (or another positive value)",
        )
        _check(
            self.divergence in self.DIVERGENCES,
            f"loss.divergence={self.divergence!r} is unknown; use one of {', '.join(self.DIVERGENCES)}",
        )
        _check(
            0.0 <= self.beta <= 1.0,
            f"loss.beta={self.beta} is outside [0, 1]; pass loss.beta=<value in [0, 1]> "
            "(0 = forward-KL end, 1 = reverse-KL end of jsd_normalized and symmetric)",
        )
        _check(
            self.impl in self.IMPLS,
            f"loss.impl={self.impl!r} is unknown; use one of {', '.join(self.IMPLS)}",
        )
        _check(self.chunk_mb > 0, f"loss.chunk_mb={self.chunk_mb} must be > 0 (MiB of one [chunk, vocabulary] fp32 "
               "buffer); pass loss.chunk_mb=128")
        _check(self.cross_tokenizer in self.CROSS_TOKENIZER,
               f"loss.cross_tokenizer={self.cross_tokenizer!r} is unknown; use one of "
               f"{', '.join(self.CROSS_TOKENIZER)}")
        weights = (self.gold_matched_weight, self.gold_unmatched_weight)
        _check(weights == (None, None) or (None not in weights and min(weights) >= 0 and sum(weights) > 0),
               f"loss.gold_matched_weight={weights[0]} and loss.gold_unmatched_weight={weights[1]}: give both, each "
               ">= 0 and not both 0, or neither (GOLD's weights)")
