"""Process environment (single process now; torchrun/SLURM ranks plug in here) and on-device reductions."""

from kdsweep.distributed.env import DistEnv, single_process

__all__ = ["DistEnv", "single_process"]
