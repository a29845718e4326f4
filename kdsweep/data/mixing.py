"""Seeded choices over rows and samples: the held-out split of a source and the weighted mix of sources.

Both are pure functions of their arguments (Python's ``random.Random(seed)``, never the rank or the world size),
so every rank and every trial of a sweep that asks for the same data gets the same rows in the same order.
"""

from __future__ import annotations

import random
from typing import Sequence

from kdsweep.config.schema import DataConfig


def hold_out(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) indices of ``n`` rows: a seeded ``fraction`` of them (at least one) held out, both in
    their original order."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    held = set(order[: max(1, round(n * fraction))])
    return [i for i in range(n) if i not in held], [i for i in range(n) if i in held]


def split_indices(n: int, cfg: DataConfig) -> tuple[list[int], list[int], list[int]]:
    """(train, eval, test) indices of a training source's ``n`` rows, each in their original order: the eval rows
    held out first (none with ``data.eval_datasets``), then the test rows from the rest (none with
    ``data.test_datasets`` or ``test_fraction`` 0), so a test split leaves the eval rows as they were."""
    kept, held = (list(range(n)), []) if cfg.eval_datasets else hold_out(n, cfg.eval_fraction, cfg.split_seed)
    if cfg.test_datasets or not cfg.test_fraction or not kept:
        return kept, held, []
    rest, test = hold_out(len(kept), cfg.test_fraction, cfg.split_seed + 1)
    return [kept[i] for i in rest], held, [kept[i] for i in test]


def mix_counts(weights: Sequence[float], total: int) -> list[int]:
    """How many of ``total`` samples each source gives: proportional to its weight, rounded by largest
    remainder so the counts sum to ``total`` exactly."""
    norm = sum(weights)
    exact = [total * w / norm for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def weighted_mix(sizes: Sequence[int], weights: Sequence[float], total: int, seed: int) -> list[tuple[int, int]]:
    """``total`` (source, sample) pairs, ``mix_counts`` of them from each source, in a seeded random order.

    A source asked for fewer samples than it holds gives a seeded subset; asked for more, it gives whole seeded
    passes over its samples before any sample repeats (up-sampling)."""
    rng = random.Random(seed)
    picks: list[tuple[int, int]] = []
    for source, (size, count) in enumerate(zip(sizes, mix_counts(weights, total))):
        if count and not size:
            raise ValueError(f"source {source} has no samples but weight {weights[source]}")
        drawn: list[int] = []
        while len(drawn) < count:
            one_pass = list(range(size))
            rng.shuffle(one_pass)
            drawn += one_pass
        picks += [(source, i) for i in drawn[:count]]
    rng.shuffle(picks)
    return picks
