"""The error every config check raises, and the one-line check the sections share."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user error in the configuration: one line naming the field and the fix."""


class RanksFailed(RuntimeError):
    """A rank of a job of several failed and its peers were ended: the message is the job's one line (from the
    ranks' failure records, ``distributed.failure``); ``config_error`` when it was bad input (exit code 2)."""

    def __init__(self, line: str, config_error: bool = False) -> None:
        super().__init__(line)
        self.config_error = config_error


class JobError(RuntimeError):
    """A job's failure that is no bug and says itself in one line (what happened, where, the fix): the job prints
    ``kdsweep: error: <line>`` and exits 1, without a traceback (a full disk at a checkpoint)."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
