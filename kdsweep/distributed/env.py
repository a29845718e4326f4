"""Who this process is among the ranks of a job, and the few collectives the loop needs.

The loop calls these helpers unconditionally; with one rank they cost nothing, so there are no
``if world_size > 1`` branches in training code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """Rank layout of the current job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0: the only rank that writes records, logs and exports."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place (on device, no host sync) and return it."""
        if self.active:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def barrier(self) -> None:
        if self.active:
            dist.barrier()


def single_process() -> DistEnv:
    return DistEnv()
