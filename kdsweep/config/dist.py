"""The ``dist`` section: the ranks of a job and how the models are sharded over them."""

from __future__ import annotations

from dataclasses import dataclass

from kdsweep.config.base import _check


TEACHER_PLACEMENTS = ("auto", "replicate", "node", "world")

STUDENT_MESHES = ("fsdp", "hsdp")


@dataclass(frozen=True, kw_only=True)
class DistConfig:
    """How many ranks a job has and how the models are sharded over them (FSDP2)."""

    nproc_per_node: int = 1
    """Local ranks to spawn for a job started by hand (torch's elastic launcher). Under torchrun or SLURM the
    launcher decides the ranks and this is ignored."""
    master_addr: str = "127.0.0.1"
    """Rendezvous address of locally spawned ranks (torchrun and SLURM bring their own)."""
    master_port: int = 0
    """Rendezvous port of locally spawned ranks; 0 picks a free one."""
    reshard_after_forward: bool = True
    """Free gathered parameters after each forward (FSDP2 FULL_SHARD); false keeps them until backward
    (SHARD_GRAD_OP)."""
    teacher_placement: str = "auto"
    """Where each frozen teacher's weights live on several ranks. ``replicate``: a whole copy on every rank (no
    collective for the teacher in a step). ``node``: sharded within each node, replicated across nodes (a 2-D
    device mesh: its all-gathers never leave the node). ``world``: sharded over every rank (each micro-batch
    all-gathers the whole teacher across the job). ``auto``: ``replicate`` when the teacher's weights in their dtype,
    beside the student's share and the teachers already replicated, fit ``1 - memory_headroom`` of the rank's
    ``device_memory_gb``, else ``node``. The teacher cache's build places its teacher the same way."""
    student_mesh: str = "fsdp"
    """How the student is sharded on several ranks: ``fsdp`` over every rank, or ``hsdp`` within each node and
    replicated across nodes (gradients reduce-scattered in the node, then all-reduced across nodes), as torchtitan
    does for multi-node data parallelism. With one node both are the same."""
    device_memory_gb: float = 0.0
    """The memory budget of one rank's device that ``teacher_placement=auto`` plans against, in GB (1e9 bytes);
    0 = the device's own (a GPU's total memory; on CPU the host's memory divided by its local ranks)."""
    memory_headroom: float = 0.25
    """Share of ``device_memory_gb`` kept free of weights and optimizer state for activations, the loss's chunk
    buffers and the allocator, when ``teacher_placement=auto`` decides."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of storing them."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2 CPUOffloadPolicy)."""
    compile: bool = False
    """torch.compile each decoder layer (slow first step; pays off at real sizes on GPUs)."""
    timeout_s: int = 600
    """Collective timeout: a rank that waits this long for the others fails the job instead of hanging."""

    def __post_init__(self) -> None:
        _check(self.nproc_per_node >= 1, f"dist.nproc_per_node={self.nproc_per_node} must be >= 1")
        _check(0 <= self.master_port < 65536,
               f"dist.master_port={self.master_port} must be in [0, 65535] (0 = any free port)")
        _check(bool(self.master_addr), "dist.master_addr is empty; pass dist.master_addr=127.0.0.1 for local ranks")
        _check(self.timeout_s > 0, f"dist.timeout_s={self.timeout_s} must be > 0")
        _check(self.teacher_placement in TEACHER_PLACEMENTS, f"dist.teacher_placement={self.teacher_placement!r} is "
               f"unknown; use one of {', '.join(TEACHER_PLACEMENTS)}")
        _check(self.student_mesh in STUDENT_MESHES, f"dist.student_mesh={self.student_mesh!r} is unknown; use one "
               f"of {', '.join(STUDENT_MESHES)}")
        _check(self.device_memory_gb >= 0, f"dist.device_memory_gb={self.device_memory_gb} must be >= 0 "
               "(0 = the device's own memory)")
        _check(0 <= self.memory_headroom < 1, f"dist.memory_headroom={self.memory_headroom} must be in [0, 1); "
               "pass dist.memory_headroom=0.25")
