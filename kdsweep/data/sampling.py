"""Resumable, world-size independent batch order.

The sequences of global step ``s`` are a pure function of (seed, s): position ``p = s·B + i`` of the stream
falls in epoch ``p // N`` at index ``perm_epoch[p % N]``. Resuming needs only the step number, and the global
batch (hence the loss and the gradients) does not depend on how many ranks or micro-batches share it.
"""

from __future__ import annotations

import hashlib

import torch


def stream_seed(*parts: object) -> int:
    """A seed for one item's own random stream (a cached row's draws, a prompt's completion), from what names it:
    the same in any process, on any rank, whatever else is drawn."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:7], "big")


class StepSampler:
    """Global batches of sequence indices for each optimizer step."""

    def __init__(self, num_sequences: int, batch_size: int, seed: int) -> None:
        if num_sequences < 1:
            raise ValueError("StepSampler needs at least one sequence")
        self.num_sequences = num_sequences
        self.batch_size = batch_size
        self.seed = seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.num_sequences, generator=g)}  # keep one epoch cached
        return self._perms[epoch]

    def global_batch(self, step: int) -> torch.Tensor:
        """Indices ``[batch_size]`` of optimizer step ``step`` (0-based)."""
        positions = range(step * self.batch_size, (step + 1) * self.batch_size)
        return torch.stack([self._perm(p // self.num_sequences)[p % self.num_sequences] for p in positions])

    def rows_of_first_steps(self, steps: int) -> torch.Tensor:
        """The sorted indices of every row the first ``steps`` steps read (all of them from one epoch on)."""
        positions = steps * self.batch_size
        if positions >= self.num_sequences:
            return torch.arange(self.num_sequences)
        return self._perm(0)[:positions].sort().values

    def rank_micro_batches(self, step: int, rank: int, world_size: int, micro_batch_size: int) -> list[torch.Tensor]:
        """This rank's contiguous share of the global batch, cut into micro-batches of indices."""
        share = self.global_batch(step).tensor_split(world_size)[rank]
        return list(share.split(micro_batch_size))
