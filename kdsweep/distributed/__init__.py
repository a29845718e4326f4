"""Process environment (single, torchrun, SLURM), process groups, FSDP2 sharding, on-device reductions."""

from kdsweep.distributed.env import DistEnv, detect, device_for, process_group, single_process

__all__ = ["DistEnv", "detect", "device_for", "process_group", "single_process"]
