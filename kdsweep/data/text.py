"""Plain-text corpora: read documents, hold out an eval split, tokenize into fixed-length sequences.

Documents are concatenated with EOS and cut into windows of ``seq_len + 1`` tokens (inputs are the first
``seq_len``, labels the last ``seq_len``), so every training token has a label and no padding is needed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

EMBEDDED_CORPUS = Path(__file__).parent / "corpus" / "kjv.txt"


def read_documents(path: str | Path) -> list[str]:
    """Documents of one file: one per non-empty line of a ``.txt``, the ``text`` field of each ``.jsonl`` row."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix == ".jsonl":
        return [json.loads(line)["text"] for line in lines if line.strip()]
    return [line for line in lines if line.strip()]


def split_documents(docs: Sequence[str], eval_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Seeded hold-out of ``eval_fraction`` of the documents (at least one); returns (train, eval)."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(docs) * eval_fraction))
    held = set(order[:n_eval])
    return [d for i, d in enumerate(docs) if i not in held], [d for i, d in enumerate(docs) if i in held]


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
    train, held = split_documents(train, eval_fraction, split_seed)
    return Corpus(train=train, eval=held)


def tokenize_to_sequences(tokenizer: Any, docs: Sequence[str], seq_len: int) -> "torch.Tensor":
    """``[num_sequences, seq_len + 1]`` int64 windows over the EOS-joined token stream (the tail is dropped)."""
    import torch

    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for doc_ids in tokenizer(list(docs), add_special_tokens=False)["input_ids"]:
        ids.extend(doc_ids)
        ids.append(eos)
    stream = torch.tensor(ids, dtype=torch.long)
    n = (len(stream) - 1) // seq_len
    if n == 0:
        return stream.new_zeros((0, seq_len + 1))
    # Windows overlap by one token: the label of a window's last input is the next window's first token.
    return stream[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len).contiguous()
