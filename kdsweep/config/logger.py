"""The ``logger`` section: where metrics go (JSONL, TensorBoard, W&B)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kdsweep.config.base import _check


WANDB_MODES = ("auto", "online", "offline")


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """Weights & Biases. Keys come from the environment (WANDB_API_KEY or ~/.netrc), never from the config."""

    enabled: bool = False
    project: str = "kdsweep"
    entity: str | None = None
    mode: str = "auto"
    """auto: online with an API key and a reachable server, else offline (``wandb sync`` later); or force one."""
    group: str | None = None
    """Runs are grouped by this; default: the study of a sweep trial, else none."""
    tags: tuple[str, ...] = ()
    """Extra tags; the teacher and the student are always tagged."""

    def __post_init__(self) -> None:
        _check(self.mode in WANDB_MODES,
               f"logger.wandb.mode={self.mode!r} is unknown; use one of {', '.join(WANDB_MODES)}")
        _check(bool(self.project), "logger.wandb.project is empty; name a W&B project")


@dataclass(frozen=True, kw_only=True)
class LoggerConfig:
    """Where metrics go (rank 0 only). JSONL is always written; TensorBoard and W&B when enabled."""

    progress_bar: bool = True
    """Show a progress bar with the live loss on rank 0."""
    tensorboard: bool = False
    """Write TensorBoard event files to ``<run dir>/tensorboard``."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
