"""The ``train`` section: the loop's length, evaluation, device and precision."""

from __future__ import annotations

from dataclasses import dataclass

from kdsweep.config.base import _check


DEVICES = ("auto", "cpu", "cuda")

DTYPES = ("fp32", "bf16", "bf16_pure")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The loop: how long, how often to evaluate, where to run."""

    max_steps: int = 60
    """Optimizer steps to train."""
    eval_every: int = 20
    """Evaluate every this many steps (and always before the first and after the last step)."""
    log_every: int = 1
    """Write a metrics row every this many steps."""
    seed: int = 0
    """Seeds LoRA init, data order and dropout."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu or cuda."""
    dtype: str = "fp32"
    """Precision. ``fp32``: everything in fp32. ``bf16``: bf16 compute with fp32 master weights, fp32 gradients
    and fp32 AdamW state for every trainable parameter (full fine-tune and LoRA alike; on one rank through autocast,
    on many through FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), frozen weights (the
    teacher, a LoRA student's base) in bf16 with no fp32 copy. ``bf16_pure``: trainable weights and optimizer state
    in bf16 too (updates below bf16's resolution, ~0.4% of a weight, are lost: warned for a full fine-tune). fp16 has
    no loss scaling here and is refused."""
    tf32: bool = True
    """TF32 tensor cores for fp32 matmuls on CUDA (Ampere and later); no effect on CPU."""
    threads: int = 0
    """torch intra-op threads on CPU; 0 keeps torch's default."""
    eval_test: bool = False
    """Evaluate the test split (``data.test_fraction`` or ``data.test_datasets``) once after training (run.json's
    ``test_after``); the sweep's confirmation trials set it, the search's never do."""

    def __post_init__(self) -> None:
        _check(self.max_steps >= 1, f"train.max_steps={self.max_steps} must be >= 1")
        _check(self.eval_every >= 1, f"train.eval_every={self.eval_every} must be >= 1")
        _check(self.log_every >= 1, f"train.log_every={self.log_every} must be >= 1")
        _check(self.device in DEVICES, f"train.device={self.device!r} is unknown; use one of {', '.join(DEVICES)}")
        _check(
            self.dtype in DTYPES,
            f"train.dtype={self.dtype!r} is not supported; use fp32, bf16 (bf16 compute, fp32 master weights) or "
            "bf16_pure (fp16 needs loss scaling kdsweep does not do)",
        )
        _check(self.threads >= 0, f"train.threads={self.threads} must be >= 0")
