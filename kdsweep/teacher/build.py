"""The teacher pass that writes a cache: every position of the rows it holds, once.

A split's cache holds a selection of its rows (``teacher.cache.rows``: those the run's steps read, or all; the
held-out split always all), kept in ascending order; their positions, one row after another, form the cache's
stream. Every rank of the job that builds it takes a contiguous share of the selection and runs the (sharded)
teacher over it in batches; all ranks run the same number of forwards (FSDP's collectives need it), a rank with a
shorter share padding with a batch it does not write. Sampling is seeded per row, so the cache does not depend on
how many ranks built it, nor on how its rows were batched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kdsweep.config.schema import ConfigError
from kdsweep.data.batch import Batch
from kdsweep.data.cache import built_once
from kdsweep.data.integrity import SummedFile
from kdsweep.data.rows import Rows
from kdsweep.data.sampling import stream_seed
from kdsweep.distributed import DistEnv, failure
from kdsweep.distributed.fsdp import hf_model
from kdsweep.distributed.waits import from_rank0
from kdsweep.losses.blocks import block_rows
from kdsweep.models.heads import frozen_hidden, frozen_projection, logit_transform
from kdsweep.teacher.cache import CACHE_VERSION, SPLITS, Spec
from kdsweep.teacher.check import size

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint16": torch.uint16,
          "int32": torch.int32}


@dataclass(frozen=True)
class Selection:
    """The rows of one split a cache holds: ``rows`` (the tokenization cache's split), ``selected`` (ascending
    indices into it)."""

    rows: Rows
    selected: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        return self.rows.lengths[self.selected]

    @property
    def positions(self) -> int:
        return int(self.lengths.sum())


def share(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of rank ``rank``: contiguous, sizes differing by at most one."""
    return n * rank // world, n * (rank + 1) // world


def row_targets(logits: torch.Tensor, labels: torch.Tensor, spec: Spec, ignore_index: int,
                generator: torch.Generator | None) -> dict[str, torch.Tensor]:
    """What the cache keeps of one row's positions: ``logits`` ``[L, Vt]``, ``labels`` ``[L]`` → field →
    ``[L, width]``."""
    z = logits[:, : spec.vocab]
    if spec.method == "full":
        return {"logits": z.to(DTYPES[spec.dtype])}
    z = z.float()
    valid = labels != ignore_index
    label_logp = F.log_softmax(z, dim=-1).gather(-1, torch.where(valid, labels, 0).unsqueeze(-1))
    out = {"label_logp": torch.where(valid.unsqueeze(-1), label_logp, 0.0)}
    return {**sparse_fields(F.log_softmax(z / spec.temperature, dim=-1), spec, generator), **out}


def sparse_fields(logp: torch.Tensor, spec: Spec, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
    """What a sparse cache keeps of log-probabilities ``[L, V]`` at T_c: ``sample``'s k draws (and the entropy, for
    a teacher of the student's tokenizer), ``topk``'s k most likely tokens and the tail's log-mass."""
    if spec.method == "sample":
        p = logp.exp()
        ids = torch.multinomial(p, spec.k, replacement=True, generator=generator).to(DTYPES[spec.id_dtype])
        if spec.aligned:
            return {"ids": ids}
        return {"ids": ids, "entropy": -torch.where(p > 0, p * logp, 0.0).sum(-1, keepdim=True)}
    values, ids = logp.topk(spec.k, dim=-1)
    tail = logp.scatter(-1, ids, float("-inf")).logsumexp(-1, keepdim=True)
    return {"ids": ids.to(DTYPES[spec.id_dtype]), "logp": values.to(DTYPES[spec.fields()["logp"][0]]),
            "tail_logp": tail}


def _write(f: SummedFile, t: torch.Tensor) -> None:
    f.write(t.detach().contiguous().cpu().view(torch.uint8).numpy())


def _write_file(path: Path, t: torch.Tensor) -> None:
    f = SummedFile(path)
    try:
        _write(f, t)
    finally:
        f.close()


RowFields = Callable[[int, int, int], Iterator[dict[str, torch.Tensor]]]
"""(a row's place in the batch, its index in the split, its length) → its positions' fields, a block of positions at
a time, in order: field → ``[positions of the block, width]``."""

Producer = Callable[[Batch, str], contextlib.AbstractContextManager[tuple[RowFields, int]]]
"""What a teacher gives the cache for one batch of a split (a context: what the rows' fields are computed from lives
as long as it): its rows' fields, and the teacher tokens it computed."""


class PlainTargets:
    """A teacher that shares the student's tokenizer (a :data:`Producer`): :func:`row_targets` of its logits, a block
    of :func:`~kdsweep.losses.blocks.block_rows` positions at a time (a ``[block, V]`` tensor, 32 MB in fp32, whatever
    the batch), each row's draws seeded by the row, so that they do not depend on the batch or the rank. The forward
    gives the final hidden states ``[B, T, H]`` and each block is projected by the output layer (as the fused loss's
    live teacher is: no ``[B, T, V]`` tensor exists), but for a teacher that transforms its logits after its output
    layer (Gemma 2's soft-capping: :func:`~kdsweep.models.heads.logit_transform`), whose own forward's logits are
    read a block at a time."""

    def __init__(self, model: nn.Module, spec: Spec, ignore_index: int, device: torch.device) -> None:
        self.model, self.spec, self.ignore_index = model, spec, ignore_index
        self.generator = torch.Generator(device=device) if spec.method == "sample" else None
        self.fused = logit_transform(model) is None
        rows = hf_model(model).get_output_embeddings().weight.shape[0]
        self.block = block_rows(rows)

    @contextlib.contextmanager
    def __call__(self, batch: Batch, split: str) -> Iterator[tuple[RowFields, int]]:
        inputs = batch.inputs()
        out = frozen_hidden(self.model, inputs) if self.fused else self.model(**inputs).logits
        with frozen_projection(self.model) if self.fused else contextlib.nullcontext(lambda rows: rows) as head:
            def row(r: int, index: int, length: int) -> Iterator[dict[str, torch.Tensor]]:
                if self.generator is not None:  # any rank, any batch: the same draws (one stream through the blocks)
                    self.generator.manual_seed(stream_seed(self.spec.seed, split, index))
                for a in range(0, length, self.block):
                    b = min(a + self.block, length)
                    yield row_targets(head(out[r, a:b]), batch.labels[r, a:b], self.spec, self.ignore_index,
                                      self.generator)

            yield row, batch.input_ids.numel()


@torch.no_grad()
def write_split(teacher: Producer, sel: Selection, split: str, spec: Spec, out: Path, dist: DistEnv,
                device: torch.device, batch_rows: int, progress: Callable[[int], None] = lambda rows: None) -> int:
    """Write this rank's share of ``split``'s selected rows; returns the teacher tokens (positions) computed.
    ``progress`` hears how many of this rank's rows are written after each batch."""
    start, end = share(len(sel.selected), dist.rank, dist.world_size)
    mine = sel.selected[start:end].tolist()
    longest = -(-len(sel.selected) // dist.world_size)
    files = {name: SummedFile(out / f"{split}.{name}.{dist.rank}") for name in spec.fields()}  # with checksums
    computed = 0
    try:
        for first in range(0, max(longest, 1), batch_rows):
            idx = mine[first:first + batch_rows]
            batch = sel.rows.batch(idx or [0]).to(device)  # an empty share still runs the forward, writes nothing
            with teacher(batch, split) as (row_fields, tokens):
                computed += tokens
                for r, row in enumerate(idx):
                    length = int(sel.rows.offsets[row + 1] - sel.rows.offsets[row])
                    for block in row_fields(r, row, length):  # each field's file: the row's blocks in order
                        for name, values in block.items():
                            _write(files[name], values)
            progress(len(idx))
    finally:
        for f in files.values():
            f.close()
    return computed


def parts(sel: Selection, world: int) -> list[dict[str, int]]:
    """Where each rank's part lies in the split's stream of positions."""
    starts = torch.cat([torch.zeros(1, dtype=torch.long), sel.lengths.cumsum(0)])
    out = []
    for rank in range(world):
        a, b = share(len(sel.selected), rank, world)
        out.append({"rank": rank, "start": int(starts[a]), "count": int(starts[b] - starts[a])})
    return out


def check_space(root: Path, positions: int, spec: Spec) -> None:
    """One line when the cache would not fit where it is to be written (checked before the teacher loads)."""
    need = positions * spec.bytes_per_position()
    free = shutil.disk_usage(root).free
    if need > free:
        raise ConfigError(
            f"teacher.cache: {spec.describe()} for {positions} positions needs {size(need)} but "
            f"{root} has {size(free)} free; use teacher.cache.method=sample or topk with a smaller "
            "teacher.cache.k, or point teacher.cache.dir at a bigger disk"
        )


class Progress:
    """Rank 0's share of the build: every second at most, ``announce`` hears the seconds since the build began
    (``began``: before the teacher loaded) and the seconds it should still take (at the pace of the writes so far)."""

    def __init__(self, rows: int, began: float, announce: Callable[[dict[str, float]], None]) -> None:
        self.rows, self.done, self.began, self.announce = max(rows, 1), 0, began, announce
        self.writing = self.last = time.perf_counter()

    def __call__(self, rows: int) -> None:
        self.done += rows
        now = time.perf_counter()
        if now - self.last >= 1.0 and self.done:
            self.last = now
            self.announce({"elapsed_s": now - self.began,
                           "eta_s": (now - self.writing) * (self.rows / self.done - 1)})


def ensure(root: Path, key: str, spec: Spec, splits: dict[str, Selection], load: Callable[[], Producer], dist: DistEnv,
           device: torch.device, batch_rows: int, info: dict[str, Any],
           announce: Callable[[dict[str, float]], None] = lambda progress: None) -> tuple[Path, dict[str, Any] | None]:
    """The cache ``root/key``, built first by this job's ranks when it does not exist (every rank calls this).

    Returns (its directory, the build's stats, or None when it was already there). ``load`` builds the teacher
    (a collective when sharded) and what it gives the cache; it is called only when the cache must be built, and
    dropped after. ``announce``
    hears how the build progresses (on rank 0).
    """
    root.mkdir(parents=True, exist_ok=True)
    if not (root / key).is_dir():
        check_space(root, sum(sel.positions for sel in splits.values()), spec)
    stats: dict[str, Any] | None = None

    def build(tmp: Path) -> dict[str, Any]:
        failure.doing(f"building the teacher cache {root / key}")
        t0 = time.perf_counter()
        teacher = load()
        loaded = time.perf_counter() - t0
        mine = sum(-(-len(sel.selected) // dist.world_size) for sel in splits.values())
        progress = Progress(mine, t0, announce) if dist.is_main else (lambda rows: None)
        computed = sum(write_split(teacher, splits[s], s, spec, tmp, dist, device, batch_rows, progress)
                       for s in SPLITS)
        del teacher
        if device.type == "cuda":
            torch.cuda.empty_cache()
        computed = int(sum(dist.gather_floats(float(computed))))
        dist.barrier()  # every rank's parts are complete
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "teacher_load_s": loaded, "ranks": dist.world_size, "device": device.type,
                "teacher_tokens": computed, "device_seconds": seconds * dist.world_size}

    with contextlib.ExitStack() as held:
        def claim() -> str:  # rank 0 takes the build's lock, however long another job holds it (saying so)
            _, tmp = held.enter_context(built_once(root, key, what=f"the teacher cache {root / key}"))
            return str(tmp) if tmp is not None else ""

        # the others wait outside any collective, for rank 0's word: build into this directory, or read the cache
        failure.doing(f"waiting for the teacher cache {root / key} (another job may be building it)")
        tmp = from_rank0(dist, f"take the build lock of the teacher cache {root / key}", claim)
        if tmp:
            stats = build(Path(tmp))
            if dist.is_main:
                meta = {"version": CACHE_VERSION, "spec": spec.__dict__, **info, "built": stats,
                        "splits": {s: {"positions": sel.positions, "rows": len(sel.selected), "of_rows": len(sel.rows),
                                       "parts": parts(sel, dist.world_size)} for s, sel in splits.items()}}
                for s, sel in splits.items():
                    _write_file(Path(tmp) / f"{s}.rows", sel.selected.to(torch.int64))
                (Path(tmp) / "meta.json").write_text(json.dumps(meta, indent=1))
    # renamed into place (the lock released) before anyone reads it: rank 0 says so once it is
    from_rank0(dist, f"put the teacher cache {root / key} in place", lambda: None)
    return root / key, stats
