"""Who this process is among the ranks of a job, and the few collectives the loop needs.

The rank layout comes from the environment: torchrun / torch's elastic agent (RANK, WORLD_SIZE, ...), or
SLURM (SLURM_PROCID, SLURM_NTASKS, ... as set by srun or submitit), or nothing (one rank). SLURM variables are
mapped to the torch ones with a master port derived from the job id, so every task of a job agrees on it
without talking. The loop calls the helpers unconditionally; with one rank they cost nothing, so there are no
``if world_size > 1`` branches in training code.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import subprocess
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """Rank layout of the current job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    source: str = "single"
    """Where the layout came from: single, torchrun or slurm."""

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

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank (stop decisions that all ranks must share)."""
        if not self.active:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def gather_floats(self, value: float) -> list[float]:
        """Every rank's ``value``, in rank order, on every rank."""
        if not self.active:
            return [value]
        t = torch.tensor([value], dtype=torch.float64, device=_collective_device())
        out = [torch.zeros_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t)
        return [x.item() for x in out]

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.active:
            dist.barrier()


def single_process() -> DistEnv:
    return DistEnv()


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def slurm_master_port(job_id: str) -> int:
    """A port every task of a SLURM job derives alike from its job id, spread over 20000–39999."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return 20000 + int(digits) % 20000


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list (``node[01-04],gpu7`` → ``node01``)."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    m = re.match(r"([^,\[]+)(?:\[(\d+))?", nodelist)  # scontrol unavailable: expand the first range by hand
    return (m.group(1) + (m.group(2) or "")) if m else "127.0.0.1"


def detect(environ: Mapping[str, str] | None = None) -> DistEnv:
    """The rank layout from torchrun's variables, else SLURM's, else one rank."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env.get("MASTER_PORT", 29500)),
            source="torchrun",
        )
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        job = env.get("SLURM_JOB_ID", "0")  # unique per array task too
        return DistEnv(
            rank=int(env["SLURM_PROCID"]), world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=first_slurm_host(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "127.0.0.1"))),
            master_port=slurm_master_port(job), source="slurm",
        )
    return DistEnv()


def device_for(name: str, env: DistEnv) -> torch.device:
    """The device of this rank: ``auto`` is the rank's GPU when there are GPUs, else the CPU."""
    from kdsweep.config.schema import ConfigError

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is visible; pass train.device=cpu or auto")
        return torch.device("cuda", env.local_rank)
    return torch.device(name)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@contextlib.contextmanager
def process_group(env: DistEnv, device: torch.device, timeout_s: float = 600) -> Iterator[DistEnv]:
    """Join the job's process group for the duration of the block (nothing to do for one rank)."""
    if env.world_size == 1:
        yield env
        return
    os.environ.update(
        RANK=str(env.rank), WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(env.local_rank),
        MASTER_ADDR=env.master_addr, MASTER_PORT=str(env.master_port),
    )
    if device.type == "cuda":
        torch.cuda.set_device(env.local_rank)
    dist.init_process_group(backend_for(device), timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield env
    finally:
        dist.destroy_process_group()
