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
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


def kdsweep_cache() -> Path:
    """``$KDSWEEP_CACHE``, default ``~/.cache/kdsweep``."""
    return Path(os.environ.get("KDSWEEP_CACHE", Path.home() / ".cache" / "kdsweep"))


@contextlib.contextmanager
def built_once(root: Path, name: str) -> Iterator[tuple[Path, Path | None]]:
    """Yield (final dir, temp dir to fill or None when already built); the temp dir is renamed on success."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another job building the same artefact: wait for it
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
