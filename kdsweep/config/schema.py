"""Typed, validated configuration of one kdsweep run.

Pure Python: no torch, hydra or omegaconf here, so composing and validating many sweep points stays instant.
Every dataclass is keyword-only and checks itself in ``__post_init__``; every error is a :class:`ConfigError`
whose message names the field and the fix.

Each section lives in its own module (``kdsweep.config.model``, ``.data``, ``.loss``, ``.optim``, ``.train``,
``.logger``, ``.profiler``, ``.checkpoint``, ``.dist``, ``.rollout``, ``.downstream``, ``.trial``; the whole job in
``.run``, the error in ``.base``); this module gathers their public names in one place.
"""

from kdsweep.config.base import ConfigError, JobError, RanksFailed
from kdsweep.config.checkpoint import CheckpointConfig
from kdsweep.config.data import (
    FORMATS,
    MIXES,
    PACK_STRATEGIES,
    SEQUENCES,
    TRUNCATIONS,
    DataConfig,
    DatasetConfig,
)
from kdsweep.config.dist import STUDENT_MESHES, TEACHER_PLACEMENTS, DistConfig
from kdsweep.config.downstream import DownstreamConfig
from kdsweep.config.logger import WANDB_MODES, LoggerConfig, WandbConfig
from kdsweep.config.loss import DIVERGENCES, LossConfig
from kdsweep.config.model import (
    CACHE_METHODS,
    CACHE_ROWS,
    TEACHER_LOGITS,
    ZOO_NAMES,
    ModelSource,
    StudentConfig,
    TeacherCacheConfig,
    TeacherConfig,
    TeacherMember,
)
from kdsweep.config.optim import SCHEDULES, OptimConfig
from kdsweep.config.profiler import ProfilerConfig
from kdsweep.config.rollout import RolloutConfig
from kdsweep.config.run import RunConfig
from kdsweep.config.train import DEVICES, DTYPES, TrainConfig
from kdsweep.config.trial import TrialConfig

__all__ = [
    "CACHE_METHODS",
    "CACHE_ROWS",
    "DEVICES",
    "DIVERGENCES",
    "DTYPES",
    "FORMATS",
    "MIXES",
    "PACK_STRATEGIES",
    "SCHEDULES",
    "SEQUENCES",
    "STUDENT_MESHES",
    "TEACHER_LOGITS",
    "TEACHER_PLACEMENTS",
    "TRUNCATIONS",
    "WANDB_MODES",
    "ZOO_NAMES",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DatasetConfig",
    "DistConfig",
    "DownstreamConfig",
    "JobError",
    "LoggerConfig",
    "LossConfig",
    "ModelSource",
    "OptimConfig",
    "ProfilerConfig",
    "RanksFailed",
    "RolloutConfig",
    "RunConfig",
    "StudentConfig",
    "TeacherCacheConfig",
    "TeacherConfig",
    "TeacherMember",
    "TrainConfig",
    "TrialConfig",
    "WandbConfig",
]
