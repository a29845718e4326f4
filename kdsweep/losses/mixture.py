"""Several teachers' targets for the same N tokens (``teachers=[...]``): one more kind of :mod:`kdsweep.losses.targets`.

The KD term of a mixture is the **weighted mean of the divergences** to each teacher,

    D_mix(student) = Σ_i w_i · D_i(teacher_i, student) / Σ_i w_i

each D_i as that teacher's targets define it (the same-tokenizer divergence on its logits or its cache, GOLD or ULD
over aligned spans for a teacher with another tokenizer), not the divergence to a mixed distribution: teachers
with different vocabularies have no common distribution to mix, and the mean of divergences keeps each teacher's
loss exactly as it is alone (one teacher of weight w is that teacher). Its gradient is the weighted mean of the
teachers' gradients. The logged distance and the teacher's CE are the same weighted means of each teacher's.
Chunks never cut any teacher's span (:func:`~kdsweep.losses.targets.cuts_avoiding`), so chunking changes nothing
beyond summation order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kdsweep.losses.targets import cuts_avoiding


@dataclass
class Mixture:
    parts: list[Any]
    """Each teacher's targets (any kind) for the same tokens."""
    weights: list[float]
    """Each teacher's weight, normalised here to sum to 1 (checked positive by the config)."""
    picks = None
    """Each teacher's divergence reads every token's log-prob (one part's draws are not all the mixture reads)."""

    def __post_init__(self) -> None:
        total = sum(self.weights)
        self.weights = [w / total for w in self.weights]
        temperatures = {p.kl_temperature for p in self.parts}
        if len(temperatures) != 1:
            raise ValueError("the teachers' targets log their distance at different temperatures "
                             f"{sorted(temperatures)}")

    def __len__(self) -> int:
        return len(self.parts[0])

    @property
    def exact(self) -> bool:
        return all(p.exact for p in self.parts)

    @property
    def measured(self) -> bool:
        return all(p.measured for p in self.parts)

    @property
    def kl_temperature(self) -> float:
        return self.parts[0].kl_temperature

    @property
    def vocab(self) -> int:
        """The student vocabulary every teacher's distribution is compared over: the smallest any of them takes."""
        return min(p.vocab for p in self.parts)

    @property
    def extent(self) -> list[tuple[int, int]]:
        return [e for p in self.parts for e in p.extent]

    def cuts(self, num_chunks: int) -> list[int]:
        return cuts_avoiding(len(self), num_chunks, self.extent)

    def split(self, num_chunks: int) -> list["Mixture"]:
        return self.split_at(self.cuts(num_chunks))

    def split_at(self, sizes: list[int]) -> list["Mixture"]:
        chunks = [p.split_at(sizes) for p in self.parts]
        return [Mixture(list(parts), self.weights) for parts in zip(*chunks)]

    def _mean(self, each: Any) -> torch.Tensor:
        return sum(w * each(p) for w, p in zip(self.weights, self.parts))

    def divergence(self, log_q: torch.Tensor, divergence: str, beta: float, temperature: float) -> torch.Tensor:
        """``[n]`` Σ_i w_i D_i(teacher_i, student) from the student's log-probs at ``temperature``."""
        return self._mean(lambda p: p.divergence(log_q, divergence, beta, temperature))

    def kl(self, log_q: torch.Tensor) -> torch.Tensor:
        return self._mean(lambda p: p.kl(log_q))

    def kl_is(self, divergence: str, beta: float, temperature: float) -> bool:
        return all(p.kl_is(divergence, beta, temperature) for p in self.parts)

    def teacher_ce(self, labels: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
        return self._mean(lambda p: p.teacher_ce(labels, vocab, ignore_index))


__all__ = ["Mixture"]
