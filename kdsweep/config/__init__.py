"""Typed run configuration: dataclasses, validation and the one-time conversion from a plain dict."""

from kdsweep.config.convert import SWEEP_KNOBS, to_run_config
from kdsweep.config.schema import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    DistConfig,
    LoggerConfig,
    ProfilerConfig,
    WandbConfig,
    LossConfig,
    OptimConfig,
    RunConfig,
    StudentConfig,
    TeacherCacheConfig,
    TeacherConfig,
    TrainConfig,
    TrialConfig,
)

__all__ = [
    "SWEEP_KNOBS",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DistConfig",
    "LoggerConfig",
    "ProfilerConfig",
    "WandbConfig",
    "LossConfig",
    "OptimConfig",
    "RunConfig",
    "StudentConfig",
    "TeacherCacheConfig",
    "TeacherConfig",
    "TrainConfig",
    "TrialConfig",
    "to_run_config",
]
