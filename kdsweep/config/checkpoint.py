"""The ``checkpoint`` section: step checkpoints and the final exports."""

from __future__ import annotations

from dataclasses import dataclass

from kdsweep.config.base import _check


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Step checkpoints for resuming, and the final exports."""

    save_every: int = 20
    """Write a step checkpoint every this many optimizer steps (0 disables step checkpoints)."""
    keep_last: int = 2
    """Keep this many step checkpoints; older ones are deleted once a newer one is complete."""
    resume: bool = True
    """Resume from the latest complete checkpoint in the output directory, if there is one."""
    export_adapter: bool = True
    """Save the peft adapter at the end (LoRA runs)."""
    export_merged: bool = True
    """Save the merged HF model (adapter folded into the base) at the end, in its own directory."""

    def __post_init__(self) -> None:
        _check(self.save_every >= 0, f"checkpoint.save_every={self.save_every} must be >= 0 (0 disables)")
        _check(self.keep_last >= 1, f"checkpoint.keep_last={self.keep_last} must be >= 1")
