"""The key of a run's rows in the tokenization cache: a hash of everything that determines them (no torch).

The sources' content (a file's bytes, a folder's files, a hub dataset's cached Arrow files; not where they lie),
their kind, the tokenizer's files, the chat template and every data setting that shapes the rows (not the batch
sizes). Pure Python, so the sweep controller and the teacher cache's pre-flight can name a cache without torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from kdsweep.config.schema import DataConfig
from kdsweep.data.cache import kdsweep_cache
from kdsweep.data.formats import chat_template
from kdsweep.data.sources import content_hash, eval_sources, test_sources, train_sources
from kdsweep.hub import hub_id

DATA_VERSION = 1
"""Bump when the rows built from the same inputs change, so old caches are not reused."""
TOKENIZER_FILES = ("tokenizer", "special_tokens", "added_tokens", "chat_template", "vocab", "merges", "spiece")
"""Prefixes of the files in a model directory that define its tokenizer."""
# Settings that batch the rows but do not shape them: left out of the cache key.
BATCHING = ("batch_size", "micro_batch_size", "eval_batch_size", "max_eval_sequences", "cache_dir")


def cache_key(cfg: DataConfig, tokenizer_dir: Path, ignore_index: int, memo_dir: Path, view: str | None = None) -> str:
    """Hash of everything that determines the rows (see the module docstring); ``view``: the identity of a second
    model's reading kept with them (kdsweep.data.views), if any."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in BATCHING}
    # a source counts by its content and kind, wherever it lies
    for section in ("datasets", "eval_datasets", "test_datasets"):
        settings[section] = [{**ds,
                              "path": "hub" if hub_id(ds["path"]) else Path(ds["path"]).suffix.lower() or "folder"}
                             for ds in settings[section]]
    files = [content_hash(ds.path, memo_dir) for _, ds in train_sources(cfg) + eval_sources(cfg) + test_sources(cfg)]
    parts = [DATA_VERSION, settings, files, tokenizer_digest(tokenizer_dir), chat_template(cfg.chat_template),
             ignore_index]
    parts += [view] if view is not None else []  # rows without views keep their key
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def tokenizer_digest(tokenizer_dir: Path) -> str:
    """The content of the files in a model directory that define its tokenizer."""
    tok = hashlib.sha256()
    for f in sorted(tokenizer_dir.iterdir()):
        if f.is_file() and f.name.startswith(TOKENIZER_FILES):
            tok.update(f.name.encode() + b"\0" + f.read_bytes())
    return tok.hexdigest()


def cache_root(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir) if cfg.cache_dir else kdsweep_cache() / "data"


def data_key(cfg: DataConfig, tokenizer_dir: Path, ignore_index: int, view: str | None = None) -> str:
    """The key of the run's rows in the cache (file hashes memoized beside it)."""
    return cache_key(cfg, tokenizer_dir, ignore_index, cache_root(cfg) / "hashes", view)
