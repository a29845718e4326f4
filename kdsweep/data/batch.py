"""The micro-batch every model forward of a KD job takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Batch:
    """One micro-batch. ``labels`` are already shifted (``labels[t]`` is the target of ``input_ids[t]``) and
    ``ignore_index`` where a token does not count."""

    input_ids: torch.Tensor
    """``[B, T]``"""
    labels: torch.Tensor
    """``[B, T]``"""
    position_ids: torch.Tensor | None = None
    """``[B, T]`` packed rows: positions restart at 0 with every document, and with ``attention_mask=None``
    transformers builds a block-diagonal causal mask from them (no attention across documents)."""
    attention_mask: torch.Tensor | None = None
    """``[B, T]`` padded rows: 1 on tokens, 0 on padding."""
    rows: torch.Tensor | None = None
    """``[B]`` (on the CPU) the indices of these rows in their split, for whatever was computed per row beforehand
    (a teacher-logit cache)."""
    own_samples: bool = False
    """The labels are tokens the student sampled itself (kdsweep.rollout): no gold labels, so only the KD term
    trains on them."""

    def kd_weight(self, kd_ratio: float) -> float:
        """The KD term's weight in this batch's loss: ``loss.kd_ratio``, or all of it on the student's own samples."""
        return 1.0 if self.own_samples else kd_ratio

    def inputs(self) -> dict[str, Any]:
        """Keyword arguments of the models' forward. ``use_cache=False`` always: with a KV cache transformers does
        not look for packed documents in the position ids, and they would attend to each other."""
        extra = {"position_ids": self.position_ids, "attention_mask": self.attention_mask}
        return {"input_ids": self.input_ids, "use_cache": False, **{k: v for k, v in extra.items() if v is not None}}

    def to(self, device: torch.device) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)
        return Batch(move(self.input_ids), move(self.labels), move(self.position_ids), move(self.attention_mask),
                     self.rows, self.own_samples)
