"""An Optuna RDB storage that outlives a short database outage (``hydra.sweeper.storage_grace_s``).

A PostgreSQL server restarted under a running sweep used to kill its controller (a pooled connection the restart had
closed: ``StorageInternalError``) and fail the trials that reported to it at that moment. Here every pooled
connection is checked before use (SQLAlchemy's ``pool_pre_ping``), and a storage call that fails because the server
is away is retried with backoff, on a fresh connection, until ``grace_s`` seconds have passed; only then does the
error reach the caller. Both ends use it: the controller, and each trial's reports (:mod:`kdsweep.sweep.handle`).

Optuna wraps an RDB storage in its ``_CachedStorage``, which calls a few of the storage's private methods as well as
its public ones: all of them are retried (:data:`PATIENT`; a test checks the list against the installed Optuna).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable

import optuna
from optuna.storages import BaseStorage, RDBStorage

log = logging.getLogger(__name__)

PRIVATE_CALLED = ("_create_new_trial", "_get_trials", "_set_trial_param", "_get_best_trial_id", "_get_stale_trial_ids")
"""The RDB storage's private methods that Optuna's ``_CachedStorage`` calls."""
PATIENT = tuple(n for n in vars(BaseStorage) if not n.startswith("_")) + PRIVATE_CALLED
"""Every method a call of the study's reaches, each retried through an outage."""
FIRST_WAIT_S, LONGEST_WAIT_S = 0.5, 10.0


class PatientRDBStorage(RDBStorage):
    """:class:`optuna.storages.RDBStorage` whose calls are retried while the database is away, for ``grace_s``."""

    def __init__(self, url: str, grace_s: float) -> None:
        super().__init__(url, engine_kwargs={"pool_pre_ping": True})
        self.grace_s = grace_s


def cause_line(e: BaseException) -> str:
    """The first line of what a storage error says of its cause (the driver's own error), at most 200 characters."""
    return (str(e.__cause__ or e).strip().splitlines() or [type(e).__name__])[0][:200]


def _patient(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: PatientRDBStorage, *args: Any, **kwargs: Any) -> Any:
        deadline, wait = time.monotonic() + self.grace_s, FIRST_WAIT_S
        while True:
            try:
                return method(self, *args, **kwargs)
            except optuna.exceptions.StorageInternalError as e:
                if time.monotonic() + wait > deadline:
                    raise
                log.warning("the study's storage is away (%s): retrying %s in %.1f s", cause_line(e), method.__name__,
                            wait)
                self.engine.dispose()  # the next try opens fresh connections
                time.sleep(wait)
                wait = min(2 * wait, LONGEST_WAIT_S)

    return call


for _name in PATIENT:
    setattr(PatientRDBStorage, _name, _patient(getattr(RDBStorage, _name)))


__all__ = ["PATIENT", "PatientRDBStorage", "cause_line"]
