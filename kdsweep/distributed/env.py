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
import gc
import os
import re
import subprocess
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist


LOCAL_RANKS = "KDSWEEP_LOCAL_RANKS"
"""Set in the ranks kdsweep spawns itself (``dist.nproc_per_node``), which torch's launcher starts like torchrun's."""
RANKS_PER_NODE = "KDSWEEP_TEST_RANKS_PER_NODE"
"""For tests: the ranks kdsweep spawns on this one machine count as nodes of this many ranks each (rank // n is its
node), so node-level placement runs its real 2-D mesh and collectives without a second machine."""


@dataclass(frozen=True)
class DistEnv:
    """Rank layout of the current job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    source: str = "single"
    """Where the layout came from: single, local (ranks kdsweep spawned for dist.nproc_per_node), torchrun or slurm."""
    local_world_size: int = 1
    """Ranks on this rank's node (the same on every node: launchers start as many per node)."""

    @property
    def nodes(self) -> int:
        """Nodes of the job (ranks over ranks per node; one when the ranks do not split evenly)."""
        per = self.local_world_size
        return self.world_size // per if per >= 1 and self.world_size % per == 0 else 1

    @property
    def node(self) -> int:
        """This rank's node (ranks are laid out node by node, as torchrun and SLURM's block distribution do)."""
        return self.rank // self.local_world_size if self.nodes > 1 else 0

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

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

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
    """Where small reduction tensors go: the GPU under NCCL (its group may also hold gloo for host tensors)."""
    if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def slurm_master_port(job_id: str, step_id: str = "0") -> int:
    """A port every task of a SLURM job step derives alike from its job and step ids, spread over 20000–39999
    (two steps of one job, or the tasks of an array, get different ones)."""
    job = int(re.sub(r"\D", "", job_id) or "0")
    step = int(re.sub(r"\D", "", step_id) or "0")
    return 20000 + (job * 7919 + step * 104729) % 20000


def _split_top(nodelist: str) -> list[str]:
    """``a[1-2],b`` → ``["a[1-2]", "b"]``: commas outside brackets separate host expressions."""
    parts, depth, cur = [], 0, ""
    for ch in nodelist:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p for p in [*parts, cur] if p]


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host of a SLURM node list, as ``scontrol show hostnames`` lists them: ``gpu[01-03,07],cpu5`` →
    gpu01 gpu02 gpu03 gpu07 cpu5 (zero padding kept; several bracket groups in one name multiply)."""
    hosts: list[str] = []
    for expr in _split_top(nodelist.strip()):
        m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", expr)
        if m is None:
            hosts.append(expr)
            continue
        head, ranges, tail = m.groups()
        tails = expand_nodelist(tail) if tail else [""]
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            hosts += [f"{head}{n:0{len(lo)}d}{t}" for n in range(int(lo), int(hi or lo) + 1) for t in tails]
    return hosts


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list (``node[01-04],gpu7`` → ``node01``)."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    hosts = expand_nodelist(nodelist)  # scontrol unavailable: the same expansion, by hand
    return hosts[0] if hosts else "127.0.0.1"


def detect(environ: Mapping[str, str] | None = None) -> DistEnv:
    """The rank layout from torchrun's variables, else SLURM's, else one rank."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        local = "local" if env.get(LOCAL_RANKS) else "torchrun"
        per_node = int(env.get("LOCAL_WORLD_SIZE") or world)
        if local == "local" and env.get(RANKS_PER_NODE):
            per_node = int(env[RANKS_PER_NODE])
        return DistEnv(
            rank=int(env["RANK"]), world_size=world, local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env.get("MASTER_PORT", 29500)),
            source=local, local_world_size=per_node,
        )
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
    if "SLURM_JOB_ID" in env and "SLURM_STEP_ID" not in env and tasks > 1:
        from kdsweep.config.schema import ConfigError

        raise ConfigError(
            f"this process runs in a SLURM allocation of {tasks} tasks but was not started by srun, so it would wait "
            f"for {tasks - 1} rank(s) that never come; start it with srun (srun python -m kdsweep ...), or run it as "
            "one rank (srun -n1 python -m kdsweep ...)"
        )
    if "SLURM_PROCID" in env and tasks > 1:
        job = env.get("SLURM_JOB_ID", "0")  # unique per array task too
        # the step's own nodes: a step on part of the allocation has its rank 0 on the first of them
        nodes = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
                 or "127.0.0.1")
        return DistEnv(
            rank=int(env["SLURM_PROCID"]), world_size=tasks, local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=first_slurm_host(nodes), master_port=slurm_master_port(job, env.get("SLURM_STEP_ID", "0")),
            source="slurm", local_world_size=slurm_tasks_per_node(env, tasks),
        )
    return DistEnv()


def slurm_tasks_per_node(env: Mapping[str, str], tasks: int) -> int:
    """The tasks on each node of a SLURM step: ``SLURM_STEP_TASKS_PER_NODE`` (``8(x2)``, or ``8,8``: the first
    node's count), else ``SLURM_NTASKS_PER_NODE``, else the tasks over the step's nodes."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        m = re.match(r"^(\d+)", env.get(name, ""))
        if m:
            return int(m[1])
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or 1)
    return max(tasks // max(nodes, 1), 1)


def device_for(name: str, env: DistEnv) -> torch.device:
    """The device of this rank: ``auto`` is the rank's GPU when there are GPUs, else the CPU."""
    from kdsweep.config.schema import ConfigError

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is visible; pass train.device=cpu or auto")
        return torch.device("cuda", cuda_index(env.local_rank, torch.cuda.device_count()))
    return torch.device(name)


def cuda_index(local_rank: int, visible: int) -> int:
    """The GPU of a local rank among those its process sees: its own when the launcher bound one GPU to each
    task (``--gpus-per-task``, ``--gpu-bind``: the task sees only ``cuda:0``), else ``cuda:<local rank>``."""
    from kdsweep.config.schema import ConfigError

    if visible == 1:
        return 0
    if local_rank >= visible:
        raise ConfigError(f"local rank {local_rank} needs a GPU but this process sees {visible} "
                          "(CUDA_VISIBLE_DEVICES); give each node as many GPUs as tasks, or one GPU per task")
    return local_rank


def backend_for(device: torch.device) -> str:
    """gloo on CPU; on GPUs NCCL for device tensors and gloo beside it for host ones (an offloaded model's gradients
    and their norm, buffers kept on the host), as torchtitan does."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


@contextlib.contextmanager
def process_group(env: DistEnv, device: torch.device, timeout_s: float = 600) -> Iterator[DistEnv]:
    """Join the job's process group for the duration of the block (nothing to do for one rank). Every collective
    of the block is counted (:mod:`kdsweep.distributed.comm`)."""
    from kdsweep.distributed import comm, placement, waits

    if env.world_size == 1:
        yield env
        return
    os.environ.update(
        RANK=str(env.rank), WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(env.local_rank),
        MASTER_ADDR=env.master_addr, MASTER_PORT=str(env.master_port),
    )
    kw: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kw["device_id"] = device  # NCCL binds the rank's GPU now, not at its first collective
    dist.init_process_group(backend_for(device), timeout=datetime.timedelta(seconds=timeout_s), **kw)
    comm.install(env.local_world_size if env.nodes > 1 else env.world_size, env.rank)
    waits.begin(env)
    try:
        yield env
        dist.barrier()  # a rank that is done does not close its connections while a peer still uses them
        waits.end(env)  # (after a failure they stay: a peer may still be reading rank 0's last word)
    finally:
        placement.forget_meshes()
        # FSDP2-sharded models hold the group through their device mesh, often in reference cycles: collected
        # now, the group's threads and sockets end here, not at interpreter exit in whatever order finalisers run
        gc.collect()
        dist.destroy_process_group()
