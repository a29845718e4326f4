"""Start N local ranks of a job through torch's elastic launcher, after checking they can start at all."""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any, Callable

import torch

from kdsweep.config.schema import ConfigError, DistConfig
from kdsweep.distributed.env import LOCAL_RANKS


def available_devices(device: torch.device) -> tuple[int, str]:
    """(how many ranks this machine can host, what they are)."""
    if device.type == "cuda":
        return torch.cuda.device_count(), "GPUs"
    return len(os.sched_getaffinity(0)), "CPUs"


def check_local_launch(cfg: DistConfig, device: torch.device) -> None:
    """One line for the ways a local multi-rank launch would fail after starting."""
    have, what = available_devices(device)
    if cfg.nproc_per_node > have:
        raise ConfigError(
            f"dist.nproc_per_node={cfg.nproc_per_node} but this machine has {have} {what}; "
            f"pass dist.nproc_per_node=<at most {have}>"
        )
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((cfg.master_addr, cfg.master_port))
    except OSError as e:
        raise ConfigError(
            f"dist.master_addr={cfg.master_addr}:{cfg.master_port} cannot be bound on this machine ({e.strerror or e}); "
            "local ranks rendezvous on this machine: pass dist.master_addr=127.0.0.1 (and dist.master_port=0 for any free port)"
        ) from None


def check_master_resolves(addr: str) -> None:
    """Under torchrun or SLURM the launcher names the master; an unresolvable name would only time out later."""
    try:
        socket.getaddrinfo(addr, None)
    except OSError as e:
        raise ConfigError(
            f"the master address {addr!r} (MASTER_ADDR / the job's first node) does not resolve ({e.strerror or e}); "
            "fix MASTER_ADDR or the node list the launcher passes"
        ) from None


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def spawn(fn: Callable[..., Any], args: tuple, cfg: DistConfig) -> Any:
    """Run ``fn(*args)`` in ``cfg.nproc_per_node`` local ranks (RANK, WORLD_SIZE, ... set); rank 0's return value.

    If any rank fails, the others are stopped and the launch raises (the job fails, it does not hang).
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    port = cfg.master_port or _free_port(cfg.master_addr)
    launch = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=cfg.nproc_per_node, run_id=f"kdsweep-{uuid.uuid4().hex[:8]}",
        rdzv_backend="static", rdzv_endpoint=f"{cfg.master_addr}:{port}", rdzv_configs={"rank": 0},
        max_restarts=0, monitor_interval=0.1,
        # spawn, not fork: in a multirun this process may already have trained a job, and a fork after OpenMP
        # kernels ran can deadlock the child's first matmul. Costs each rank its imports (seconds).
        start_method="spawn",
    )
    os.environ[LOCAL_RANKS] = "1"  # the ranks inherit it: they know dist.nproc_per_node started them, not torchrun
    try:
        return elastic_launch(launch, fn)(*args)[0]
    finally:
        os.environ.pop(LOCAL_RANKS, None)
