"""What ``train.dtype`` means for each model: the dtype its weights are held in, its master weights, how it computes.

``bf16`` is mixed precision as the documentation promises it: every trainable parameter (a full fine-tune's
weights, a LoRA adapter) is held in fp32, so are its gradient and AdamW's moments (built on it), and the forward
and backward compute in bf16 — on one rank through ``torch.autocast``, on several through FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (fp32 shards, bf16 all-gathers, fp32 gradient
reduction). Frozen weights (the teacher, a LoRA student's base) are held in bf16, with no fp32 copy. ``bf16_pure``
holds trainable weights in bf16 as well (so AdamW's state is bf16, and an update below bf16's resolution, about
0.4% of a weight, rounds away). ``fp32`` is fp32 throughout (TF32 matmuls on CUDA unless ``train.tf32=false``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager

import torch

NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    name: str
    """fp32, bf16 or bf16_pure (``train.dtype``)."""

    @property
    def mixed(self) -> bool:
        return self.name == "bf16"

    @property
    def frozen_dtype(self) -> torch.dtype:
        """Frozen weights: the teacher's, a LoRA student's base."""
        return torch.float32 if self.name == "fp32" else torch.bfloat16

    @property
    def master_dtype(self) -> torch.dtype:
        """Trainable weights, their gradients and the optimizer's state."""
        return torch.bfloat16 if self.name == "bf16_pure" else torch.float32

    def student_dtype(self, full_fine_tune: bool) -> torch.dtype:
        """What the student is read in: a full fine-tune's weights are its master weights; a LoRA base is frozen."""
        return self.master_dtype if full_fine_tune else self.frozen_dtype

    def fsdp_policy(self, trainable: bool):
        """FSDP2's mixed precision for a sharded model: bf16 compute over fp32 shards for a trainable model under
        ``bf16``; none otherwise (a frozen model already holds its weights in its compute dtype)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.mixed and trainable:
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def autocast(self, device: torch.device, sharded: bool) -> ContextManager:
        """bf16 compute for an unsharded student under ``bf16`` (a sharded one gets it from FSDP2's policy)."""
        if self.mixed and not sharded:
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


def enable_tf32(enabled: bool) -> None:
    """TF32 tensor cores for fp32 matmuls (CUDA, Ampere and later); on CPU nothing changes."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled
        torch.set_float32_matmul_precision("high" if enabled else "highest")
