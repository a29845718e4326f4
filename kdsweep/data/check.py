"""Cheap checks of the data files before a job starts (no torch, no tokenizer)."""

from __future__ import annotations

from pathlib import Path

from kdsweep.config.schema import ConfigError, RunConfig
from kdsweep.data.text import read_documents

SUFFIXES = (".txt", ".jsonl")


def check_files(key: str, files: tuple[str, ...]) -> None:
    for f in files:
        p = Path(f)
        if not p.is_file():
            raise ConfigError(f"{key}: {f} does not exist; pass {key}=[<existing .txt or .jsonl files>]")
        if p.suffix not in SUFFIXES:
            raise ConfigError(f"{key}: {f} is neither .txt (one document per line) nor .jsonl (a 'text' field per row)")
        try:
            docs = read_documents(p)
        except (ValueError, KeyError) as e:
            raise ConfigError(f"{key}: {f} is not valid {p.suffix} ({type(e).__name__}: {e}); each row needs a 'text' field") from None
        if not docs:
            raise ConfigError(f"{key}: {f} is empty (no documents); remove it from {key} or fill it")


def preflight_data(cfg: RunConfig) -> None:
    d = cfg.data
    check_files("data.train_files", d.train_files)
    check_files("data.eval_files", d.eval_files)
    if d.train_files and not d.eval_files:
        n_docs = sum(len(read_documents(f)) for f in d.train_files)
        if n_docs < 2:
            raise ConfigError(
                f"data.train_files hold {n_docs} document, too few to hold out an eval split; "
                "pass data.eval_files=[...] or add documents"
            )
