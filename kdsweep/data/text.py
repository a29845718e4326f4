"""Plain-text corpora: read documents, hold out an eval split, tokenize into fixed-length sequences.

Documents are concatenated with EOS and cut into windows of ``seq_len + 1`` tokens (inputs are the first
``seq_len``, labels the last ``seq_len``), so every training token has a label and no padding is needed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from kdsweep.data.mixing import hold_out

if TYPE_CHECKING:
    import torch

EMBEDDED_CORPUS = Path(__file__).parent / "corpus" / "kjv.txt"


def read_documents(path: str | Path) -> list[str]:
    """Documents of one file: one per non-empty line of a ``.txt``, the ``text`` field of each ``.jsonl`` row."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix == ".jsonl":
        return [json.loads(line)["text"] for line in lines if line.strip()]
    return [line for line in lines if line.strip()]


@dataclass(frozen=True)
class Corpus:
    """Train and eval documents of a run."""

    train: list[str]
    eval: list[str]


def load_corpus(train_files: Sequence[str], eval_files: Sequence[str], eval_fraction: float, split_seed: int) -> Corpus:
    """The documents a run trains and evaluates on; empty ``train_files`` means the embedded corpus."""
    train = [d for f in (train_files or [EMBEDDED_CORPUS]) for d in read_documents(f)]
    if eval_files:
        return Corpus(train=train, eval=[d for f in eval_files for d in read_documents(f)])
    kept, held = hold_out(len(train), eval_fraction, split_seed)
    return Corpus(train=[train[i] for i in kept], eval=[train[i] for i in held])


def tokenize_to_sequences(tokenizer: Any, docs: Sequence[str], seq_len: int) -> "torch.Tensor":
    """``[num_sequences, seq_len + 1]`` int64 windows over the EOS-joined token stream (the tail is dropped)."""
    from kdsweep.data.packing import windows

    eos = tokenizer.eos_token_id
    ids = tokenizer(list(docs), add_special_tokens=False)["input_ids"]
    return windows([t for doc in ids for t in (*doc, eos)], seq_len)
