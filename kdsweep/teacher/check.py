"""Cheap checks of a teacher-logit cache before anything is launched (no torch): it can be written, and it fits.

The method, divergence and temperature go together or not in the config itself (``RunConfig``); here the cache's
directory must be writable and the cache must fit in its free space, estimated as positions × bytes per position
before any teacher runs (the job checks again with the exact count before it builds).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from kdsweep.config.schema import ConfigError, RunConfig
from kdsweep.data.sources import eval_sources, train_sources
from kdsweep.teacher.cache import Spec, cache_root

BYTES_PER_TOKEN = 4
"""Text bytes per token assumed for a source that has not been tokenized yet (typical of BPE on English)."""


def size(n: float) -> str:
    """``n`` bytes as people read them."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_writable(root: Path) -> Path:
    """The nearest existing directory of ``root`` (created later), after a real write test there (root passes
    every permission check, a read-only mount does not)."""
    base = _existing_ancestor(root)
    try:
        if not base.is_dir():
            raise NotADirectoryError(f"{base} is a file")
        fd, probe = tempfile.mkstemp(dir=base, prefix=".kdsweep-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            f"teacher.cache.dir={root} is not writable ({e.strerror or e}); pass teacher.cache.dir=<a writable "
            "directory every trial can read>"
        ) from None
    return base


def estimated_positions(cfg: RunConfig) -> int:
    """Token positions the cache will hold: counted, if the rows are tokenized already, else estimated from the
    sources' bytes; with ``teacher.cache.rows=used`` at most the training rows the run's steps read."""
    from kdsweep.data.key import cache_root as data_root

    total = 0
    for _, ds in train_sources(cfg.data) + eval_sources(cfg.data):
        p = Path(ds.path)
        files = [f for f in p.rglob("*") if f.is_file()] if p.is_dir() else [p] if p.is_file() else []
        total += sum(f.stat().st_size for f in files) // BYTES_PER_TOKEN
    train, held_out = total, 0
    for stats in data_root(cfg.data).glob("*/stats.json"):  # tokenized already: exact counts of the same sources
        counted = json.loads(stats.read_text())
        if counted.get("train", {}).get("sources") and all(
                s.get("path") in {ds.path for _, ds in train_sources(cfg.data)} for s in counted["train"]["sources"]):
            train, held_out = (counted[s]["rows"] * cfg.data.seq_len for s in ("train", "eval"))
    if cfg.teacher.cache.rows == "used":
        train = min(train, cfg.train.max_steps * cfg.data.batch_size * cfg.data.seq_len)
    return train + held_out


def preflight_cache(cfg: RunConfig, vocab: int, aligned: bool = False) -> None:
    """One line for a cache that cannot be written or would not fit (``vocab``: the teacher's distribution's;
    ``aligned``: a teacher with another tokenizer's, kept on the student's aligned spans)."""
    if cfg.teacher.logits != "cache":
        return
    spec = Spec.of(cfg, vocab, aligned)
    if spec.method == "topk" and 0 < vocab <= spec.k:
        raise ConfigError(f"teacher.cache.k={spec.k} keeps the whole {vocab}-token vocabulary; use "
                          f"teacher.cache.method=full, or a k below {vocab}")
    root = cache_root(cfg)
    base = check_writable(root)
    if any(json.loads(m.read_text()).get("spec") == spec.__dict__ for m in root.glob("*/meta.json")):
        return  # a cache of this kind exists already: the job finds out whether it is this teacher's and data's
    need = estimated_positions(cfg) * spec.bytes_per_position()
    free = shutil.disk_usage(base).free
    if need > free:
        raise ConfigError(
            f"teacher.cache: {spec.describe()} for about {need // spec.bytes_per_position()} positions needs about "
            f"{size(need)} but {base} has {size(free)} free; use teacher.cache.method=sample or "
            "topk with a smaller teacher.cache.k, or point teacher.cache.dir at a bigger disk"
        )
