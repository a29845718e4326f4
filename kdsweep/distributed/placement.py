"""Where each model's weights live on the job's ranks: the one decision, from the models' sizes and the device budget.

A frozen teacher needs no optimizer and no gradient, so on several ranks it can be

- ``replicate``: a whole copy on every rank. A step issues no collective for it at all.
- ``node``: sharded within each node and replicated across nodes (FSDP2 on a 2-D device mesh, nodes × ranks per
  node): each micro-batch all-gathers it inside the node only, never across the network between nodes.
- ``world``: sharded over every rank: each micro-batch all-gathers all of its weights across the whole job.

``auto`` replicates a teacher when its weights in their dtype fit ``1 - dist.memory_headroom`` of the rank's memory
(``dist.device_memory_gb``, or the device's own) beside everything else the rank holds while it runs, else shards it
per node. Beside a live teacher: the student's share of the rank (its weights, and for each trainable parameter its
fp32 master, gradient and AdamW moments, sharded as the student is) and a training step's activations and loss path
(the memory model, :mod:`kdsweep.models.memory`); beside a teacher that builds a cache, only the build's own
working memory (the student is not loaded until it is done). Several teachers are placed one after another, each
beside what those placed before it really take on a rank: a replicated one its weights, one sharded per node its
share and what it gathers whole while it runs (its output layer and two decoder layers). The student is sharded
(``fsdp``: over every rank; ``hsdp``: within each node, replicated across nodes). The meshes are built once per
process group, and :class:`Placement` is all that ``models.load`` needs: neither the loop nor the teachers see one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from kdsweep.config.schema import DistConfig
from kdsweep.distributed.env import DistEnv

GB = 1e9
_MESHES: dict[tuple[str, int, int], Any] = {}


@dataclass(frozen=True)
class Placement:
    """How one model is laid out over the job's ranks."""

    how: str
    """single (one rank), replicate, node or world (a teacher), fsdp or hsdp (the student)."""
    why: str
    shard_ranks: int
    """Ranks each copy of the weights is sharded over (1: every rank holds all of them)."""
    nodes: int = 1
    weight_bytes: int = 0
    """The model's weights in the dtype they are held in, all of them."""

    @property
    def sharded(self) -> bool:
        return self.shard_ranks > 1

    @property
    def two_dimensional(self) -> bool:
        """Sharded within nodes and replicated across them (a 2-D mesh), rather than over every rank."""
        return self.sharded and self.nodes > 1 and self.how in ("node", "hsdp")

    def mesh(self, device: torch.device) -> Any:
        """The device mesh ``fully_shard`` takes (None: the default, every rank); all ranks call this alike."""
        if not self.two_dimensional:
            return None
        return node_mesh(device, self.nodes, self.shard_ranks)

    def record(self) -> dict[str, Any]:
        return {"placement": self.how, "sharded_over": self.shard_ranks, "nodes": self.nodes,
                "weight_bytes": self.weight_bytes, "why": self.why}


def node_mesh(device: torch.device, nodes: int, per_node: int) -> Any:
    """The ``(nodes, ranks per node)`` mesh (dims ``replicate``, ``shard``), built once per process group."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (device.type, nodes, per_node)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device.type, (nodes, per_node), mesh_dim_names=("replicate", "shard"))
    return _MESHES[key]


def forget_meshes() -> None:
    """The process group is gone, and the meshes' groups with it."""
    _MESHES.clear()


def budget_bytes(cfg: DistConfig, device: torch.device, env: DistEnv) -> tuple[float, str]:
    """(a rank's memory budget in bytes, where it comes from)."""
    if cfg.device_memory_gb > 0:
        return cfg.device_memory_gb * GB, f"dist.device_memory_gb={cfg.device_memory_gb:g}"
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory), f"the {torch.cuda.get_device_name(device)}"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total / max(env.local_world_size, 1), f"this host's memory over its {env.local_world_size} local rank(s)"


def size(nbytes: float) -> str:
    return f"{nbytes / GB:.3g} GB" if nbytes >= 0.1 * GB else f"{nbytes / 2**20:.3g} MiB"


def student_placement(cfg: DistConfig, env: DistEnv, weight_bytes: int = 0) -> Placement:
    if env.world_size == 1:
        return Placement("single", "one rank: the whole model on its device", 1, 1, weight_bytes)
    if cfg.student_mesh == "hsdp" and env.nodes > 1:
        return Placement("hsdp", f"dist.student_mesh=hsdp: sharded over the {env.local_world_size} ranks of each of "
                                 f"{env.nodes} nodes, replicated across them",
                         env.local_world_size, env.nodes, weight_bytes)
    why = "dist.student_mesh=fsdp" if cfg.student_mesh == "fsdp" else "dist.student_mesh=hsdp on one node"
    return Placement("fsdp", f"{why}: sharded over all {env.world_size} ranks", env.world_size, env.nodes, weight_bytes)


@dataclass(frozen=True)
class TeacherSize:
    """What a teacher holds on a rank, by how it is placed."""

    weights: int
    """All its weights, in the dtype they are held in."""
    whole: int = 0
    """What a sharded copy still holds unsharded while it runs: its output layer (gathered through the loss that
    projects with it) and two decoder layers (the one that runs, the one prefetched)."""

    def per_rank(self, shard_ranks: int) -> float:
        return self.weights if shard_ranks <= 1 else self.weights / shard_ranks + min(self.whole, self.weights)


def teacher_placements(cfg: DistConfig, env: DistEnv, teachers: list[TeacherSize], beside: float,
                       device: torch.device, besides: str = "the student's") -> list[Placement]:
    """Each teacher's placement, in order. An ``auto`` teacher is replicated when its weights fit beside ``beside``
    bytes per rank (``besides``: what they are: the student's share and its step, or a cache build's) and what the
    teachers placed before it take on a rank (a replicated one its weights, a sharded one its share and what it
    gathers whole: :meth:`TeacherSize.per_rank`); else it is sharded per node."""
    if env.world_size == 1:
        return [Placement("single", "one rank: the whole model on its device", 1, 1, t.weights) for t in teachers]
    budget, source = budget_bytes(cfg, device, env) if cfg.teacher_placement == "auto" else (0.0, "")
    usable = budget * (1 - cfg.memory_headroom)
    out, placed = [], 0.0
    for teacher in teachers:
        how, nbytes = cfg.teacher_placement, teacher.weights
        if how == "auto":
            fits = nbytes + beside + placed <= usable
            how = "replicate" if fits else "node"
            why = (f"auto: its {size(nbytes)} beside {besides} {size(beside)} per rank"
                   + (f" and {size(placed)} per rank of the teachers placed before it" if placed else "")
                   + f" {'fit' if fits else 'exceed'} {size(usable)} ({1 - cfg.memory_headroom:.0%} of {size(budget)}, "
                   f"{source})")
        else:
            why = f"dist.teacher_placement={how}"
        if how == "node" and env.nodes == 1:
            why += f"; one node of {env.world_size} ranks, so sharded over all of them"
        shard = {"replicate": 1, "node": env.local_world_size if env.nodes > 1 else env.world_size,
                 "world": env.world_size}[how]
        placed += teacher.per_rank(shard)
        out.append(Placement(how, why, shard, env.nodes, nbytes))
    return out


def parameter_bytes(model: torch.nn.Module) -> int:
    """The bytes of a model's parameters (each counted once: tied weights share theirs)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
