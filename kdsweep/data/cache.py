"""Artefacts built once and shared: a directory per key, built under a lock into a temp dir and renamed.

Every trial of a sweep and every rank of a job asks for the same artefact (the embedded models, a tokenized
dataset). The first asker takes an exclusive ``flock`` on ``.<name>.lock``, builds into a fresh temp directory
and renames it into place; the others wait on the lock and find the finished directory. The rename is atomic,
so even where ``flock`` does not exclude (some network file systems) a reader never sees a half-written
directory: the last builder's rename fails on the existing directory and its copy is discarded.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger(__name__)


def kdsweep_cache() -> Path:
    """``$KDSWEEP_CACHE``, default ``~/.cache/kdsweep``."""
    return Path(os.environ.get("KDSWEEP_CACHE", Path.home() / ".cache" / "kdsweep"))


SAY_EVERY_S = float(os.environ.get("KDSWEEP_WAIT_SAY_S") or 60.0)
"""How often a job waiting for another job's build says so in its log (``KDSWEEP_WAIT_SAY_S``, default a minute)."""


def _wait_for_lock(lock: Any, what: str) -> None:
    """Take the exclusive lock, saying every minute (``what``: what the holder builds) while another job holds it."""
    began = time.time()
    last = began
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if time.time() - began >= SAY_EVERY_S:
                log.info("%s: the other job's build is over after %.0f s of waiting", what, time.time() - began)
            return
        except BlockingIOError:
            pass
        now = time.time()
        if now - last >= SAY_EVERY_S:
            last = now
            log.info("%s: another job is building it (it holds %s); waited %.0f s so far", what, lock.name, now - began)
        time.sleep(0.5)


@contextlib.contextmanager
def built_once(root: Path, name: str, what: str | None = None) -> Iterator[tuple[Path, Path | None]]:
    """Yield (final dir, temp dir to fill or None when already built); the temp dir is renamed on success. ``what``
    names the artefact in the log lines said every minute while another job builds it."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    with open(root / f".{name}.lock", "w") as lock:
        if what is None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another job building the same artefact: wait for it
        else:
            _wait_for_lock(lock, what)
        if final.is_dir():
            yield final, None
            return
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            yield final, tmp
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():  # anything but "someone else finished first" is a real error
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
