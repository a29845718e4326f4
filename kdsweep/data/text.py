"""The embedded corpus (four public-domain books, one chapter per line) and its token stream.

The embedded tiny models are pre-trained on its training split; jobs read it through the same data pipeline as
users' files (``kdsweep.data.dataset``: no ``data.datasets`` means this corpus), which holds out the same split.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from kdsweep.data.mixing import hold_out

if TYPE_CHECKING:
    import torch

EMBEDDED_CORPUS = Path(__file__).parent / "corpus" / "kjv.txt"


@dataclass(frozen=True)
class Corpus:
    """Train and eval documents."""

    train: list[str]
    eval: list[str]


def embedded_corpus(eval_fraction: float, split_seed: int) -> Corpus:
    """The embedded corpus' documents, a seeded ``eval_fraction`` of them held out."""
    from kdsweep.data.sources import read_rows

    docs = [row["text"] for row in read_rows(str(EMBEDDED_CORPUS))]
    kept, held = hold_out(len(docs), eval_fraction, split_seed)
    return Corpus(train=[docs[i] for i in kept], eval=[docs[i] for i in held])


def tokenize_to_sequences(tokenizer: Any, docs: Sequence[str], seq_len: int) -> "torch.Tensor":
    """``[num_sequences, seq_len + 1]`` int64 windows over the EOS-joined token stream (the tail is dropped)."""
    from kdsweep.data.packing import windows

    eos = tokenizer.eos_token_id
    ids = tokenizer(list(docs), add_special_tokens=False)["input_ids"]
    return windows([t for doc in ids for t in (*doc, eos)], seq_len)
