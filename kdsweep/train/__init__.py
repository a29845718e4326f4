"""``run(cfg) -> RunResult``: the KD job. One ``train_step``, one ``evaluate``."""

from kdsweep.train.loop import NULL_REPORTER, Reporter, RunResult, check_resumable, prepare_data, run
from kdsweep.train.step import Learner, StepStats, train_step

__all__ = ["Learner", "NULL_REPORTER", "Reporter", "RunResult", "StepStats", "check_resumable", "prepare_data", "run",
           "train_step"]
