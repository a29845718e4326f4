"""Samples into fixed-length sequences: a length policy, packing with document boundaries, padding, streaming.

Samples are :class:`~kdsweep.data.formats.Sample` (inputs and already-shifted labels), so each document's labels
stay inside it: no label of a packed document predicts the next document's first token.

**Packing** places whole samples into rows of ``seq_len`` tokens (``best_fit``: longest first, each into the row
with the least room that holds it; ``sequential``: in order, a new row when the next one does not fit). Every
document's ``position_ids`` restart at 0, and the tail padding of a row is its own document (positions from 0,
labels ``ignore_index``).

**No attention across documents.** Two mechanisms, both checked against each document run alone in
``tests/unit/data/test_packing.py`` (transformers 5, CPU, fp32, eager and sdpa):

* pass ``position_ids`` and ``attention_mask=None``: transformers' ``masking_utils`` detects packed rows from the
  position ids (a new document wherever the position does not grow by 1) and builds a block-diagonal causal mask.
  It does so only when the 2D attention mask is None: passing an all-ones ``attention_mask`` silently turns
  the detection off and documents attend to each other.
* pass :func:`block_causal_mask` (a 4D additive mask) as ``attention_mask``; models take a 4D mask as is.

Padded rows (one sample each) are padded when a micro-batch is formed: :meth:`kdsweep.data.rows.Rows.batch`.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kdsweep.config.schema import ConfigError
from kdsweep.data.formats import Sample

POLICIES = ("truncate", "drop")
STRATEGIES = ("best_fit", "sequential")


@dataclass(frozen=True)
class LengthCounts:
    """What the length policy did to a list of samples."""

    samples: int
    """Samples kept."""
    tokens: int
    """Input tokens of the kept samples (after truncation)."""
    targets: int
    """Label tokens (not ``ignore_index``) of the kept samples."""
    truncated: int
    """Kept samples cut to the maximum length."""
    dropped: int
    """Samples left out: too long under ``drop``, or without any label token (empty, or cut before the response)."""


@dataclass(frozen=True)
class PackStats(LengthCounts):
    """Length counts plus the packed rows."""

    sequences: int
    """Rows of ``seq_len`` tokens."""
    padding_fraction: float
    """Share of the rows' tokens that are padding."""


def apply_length_policy(
    samples: Sequence[Sample], max_len: int, policy: str = "truncate", ignore_index: int = -100
) -> tuple[list[Sample], LengthCounts]:
    """Samples of at most ``max_len`` tokens: longer ones cut (``truncate``) or left out (``drop``)."""
    if policy not in POLICIES:
        raise ConfigError(f"unknown truncation policy {policy!r}; use one of {', '.join(POLICIES)}")
    if max_len < 1:
        raise ConfigError(f"sequence length {max_len} must be at least 1")
    kept, truncated, dropped = [], 0, 0
    for s in samples:
        if len(s) > max_len:
            if policy == "drop":
                dropped += 1
                continue
            s, truncated = Sample(s.input_ids[:max_len], s.labels[:max_len], s.view), truncated + 1
        if all(label == ignore_index for label in s.labels):
            dropped += 1
            continue
        kept.append(s)
    targets = sum(label != ignore_index for s in kept for label in s.labels)
    return kept, LengthCounts(len(kept), sum(map(len, kept)), targets, truncated, dropped)


def bins_sequential(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` (each ``<= capacity``) in order, a new bin whenever the next one does not fit."""
    bins: list[list[int]] = []
    room = 0
    for i, n in enumerate(lengths):
        if n > room:
            bins.append([])
            room = capacity
        bins[-1].append(i)
        room -= n
    return bins


def bins_best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: longest first, each into the open bin with the least room that holds it. The bins come
    back in the order of their first sample, so the first rows are not all the longest samples' (a capped eval
    set, ``data.max_eval_sequences``, takes the first rows)."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room, bin), sorted
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = bisect_left(free, (lengths[i], -1))
        if k == len(free):
            bins.append([])
            room, b = capacity, len(bins) - 1
        else:
            room, b = free.pop(k)
        bins[b].append(i)
        if room - lengths[i] > 0:
            insort(free, (room - lengths[i], b))
    return sorted(bins, key=min)


@dataclass(frozen=True)
class Packed:
    """Packed rows ``[N, seq_len]`` and what went into them."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    """Position of each token inside its document (0 at every document start)."""
    used: torch.Tensor
    """``[N]`` tokens of each row that belong to a sample (the rest is padding)."""
    stats: PackStats
    views: list[list[Any]] | None = None
    """Per row, its samples' :attr:`~kdsweep.data.formats.Sample.view` in order (None: the samples have none)."""


def pack(
    samples: Sequence[Sample],
    seq_len: int,
    *,
    pad_id: int,
    policy: str = "truncate",
    strategy: str = "best_fit",
    ignore_index: int = -100,
) -> Packed:
    """Samples packed into rows of ``seq_len`` tokens after :func:`apply_length_policy`."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown packing strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    kept, counts = apply_length_policy(samples, seq_len, policy, ignore_index)
    bins = (bins_best_fit if strategy == "best_fit" else bins_sequential)([len(s) for s in kept], seq_len)
    shape = (len(bins), seq_len)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, ignore_index, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    used = torch.zeros(len(bins), dtype=torch.long)
    for row, members in enumerate(bins):
        at = 0
        for i in members:
            n = len(kept[i])
            input_ids[row, at : at + n] = torch.tensor(kept[i].input_ids)
            labels[row, at : at + n] = torch.tensor(kept[i].labels)
            position_ids[row, at : at + n] = torch.arange(n)
            at += n
        position_ids[row, at:] = torch.arange(seq_len - at)  # the padding tail is a document of its own
        used[row] = at
    padding = 1.0 - counts.tokens / max(1, len(bins) * seq_len) if bins else 0.0
    stats = PackStats(**vars(counts), sequences=len(bins), padding_fraction=padding)
    views = [[kept[i].view for i in members] for members in bins] if any(s.view is not None for s in kept) else None
    return Packed(input_ids, labels, position_ids, used, stats, views)


def windows(stream: Sequence[int], seq_len: int) -> torch.Tensor:
    """``[N, seq_len + 1]`` windows over a token stream, each overlapping the next by one token (inputs are
    ``w[:-1]``, labels ``w[1:]``, so every token but the first is a label once); the tail is dropped."""
    ids = torch.tensor(list(stream), dtype=torch.long)
    n = max(0, (len(ids) - 1) // seq_len)
    if n == 0:
        return ids.new_zeros((0, seq_len + 1))
    return ids[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len).contiguous()


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` index of each token's document within its row: a new document starts where the position is 0."""
    return (position_ids == 0).long().cumsum(-1)


def block_causal_mask(position_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[B, 1, T, T]`` additive mask (0 where query t may attend key s: same document and ``s <= t``, else the
    dtype's minimum), for ``attention_mask`` of an HF model (eager or sdpa)."""
    doc = document_ids(position_ids)
    t = position_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (doc[:, :, None] == doc[:, None, :]) & causal
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[:, None]
