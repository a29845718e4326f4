"""Targets read from a teacher-logit cache (``teacher.logits=cache``): the teacher is never loaded."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Hashable, Iterator, Sequence

import torch

from kdsweep.data.batch import Batch
from kdsweep.data.integrity import CheckedFile
from kdsweep.data.rows import Rows
from kdsweep.losses.targets import Logits, Samples, Targets, TopK
from kdsweep.teacher.build import DTYPES
from kdsweep.teacher.cache import Spec, read_meta
from kdsweep.teacher.source import TeacherSource


_SIGNED = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def signed_bits(t: torch.Tensor) -> torch.Tensor:
    """``t``, or its bits as the signed integer of its width (torch has no index_put for uint16 token ids)."""
    return t.view(_SIGNED[t.dtype]) if t.dtype in _SIGNED else t


class CachedSplit:
    """One split of a cache, memory-mapped: the targets of the rows it holds (any batch of them)."""

    def __init__(self, path: Path, split: str, rows: Rows) -> None:
        meta = read_meta(path)
        self.spec, self.path, self.split = Spec(**meta["spec"]), path, split
        info = meta["splits"][split]
        CheckedFile(path / f"{split}.rows").check_all()  # every file: there, with its size; each block when read
        selected = torch.from_file(str(path / f"{split}.rows"), shared=False, size=info["rows"], dtype=torch.int64)
        if info["of_rows"] != len(rows) or int(rows.lengths[selected].sum()) != info["positions"]:
            raise ValueError(f"the teacher cache {path} was built for other {split} rows than these")
        # row -> its place in the cache's stream of positions (rows one after another, in ascending order)
        self.slot = torch.full((len(rows),), -1, dtype=torch.long)
        self.slot[selected] = torch.arange(len(selected))
        self.starts = torch.cat([torch.zeros(1, dtype=torch.long), rows.lengths[selected].cumsum(0)])
        self.rows, self.parts = rows, info["parts"]
        # the parts that hold positions (a rank may have written none), and where each starts
        self.filled = torch.tensor([i for i, p in enumerate(self.parts) if p["count"]], dtype=torch.long)
        self.filled_starts = torch.tensor([self.parts[i]["start"] for i in self.filled.tolist()], dtype=torch.long)
        self.maps: dict[str, list[torch.Tensor]] = {}
        self.checked: dict[str, list[CheckedFile]] = {}
        for name, (dtype, width) in self.spec.fields().items():
            files = [path / f"{split}.{name}.{p['rank']}" for p in self.parts]
            self.checked[name] = [CheckedFile(f) for f in files]
            self.maps[name] = [torch.from_file(str(f), shared=False, size=p["count"] * width,
                                               dtype=DTYPES[dtype]).view(p["count"], width)
                               for f, p in zip(files, self.parts)]

    def _part_of(self, positions: torch.Tensor) -> torch.Tensor:
        """``[B]`` the part (the file of the rank that wrote it) holding each position: the last non-empty part that
        starts at or before it (a rank writes whole rows, so a row's positions are all in its first one's part)."""
        return self.filled[torch.searchsorted(self.filled_starts, positions, right=True) - 1]

    def cells(self, row_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per cell of a ``[B, length]`` batch of these rows (flattened): whether it is a row's position (not
        padding), its position in the cache's stream, and the part holding it (what :meth:`gather_at` reads)."""
        slots = self.slot[row_ids]
        if bool((slots < 0).any()):
            raise ValueError(f"row {int(row_ids[slots < 0][0])} of the {self.split} split is not in the teacher cache "
                             f"{self.path} (it holds the rows of the run it was built for: teacher.cache.rows)")
        first, lengths = self.starts[slots], self.starts[slots + 1] - self.starts[slots]
        offset = torch.arange(length)
        inside = (offset[None, :] < lengths[:, None]).reshape(-1)  # [B·length]: a row's position, not padding
        position = (first[:, None] + offset[None, :]).reshape(-1)
        return inside, position, self._part_of(first).repeat_interleave(length)

    def _plan(self, inside: torch.Tensor, position: torch.Tensor, part: torch.Tensor) -> list[tuple]:
        """Where each part's positions go among these cells: ``(part, cells or None for all of them, offsets in the
        part's file)``, computed once for every field read at these cells."""
        if len(self.filled) == 1 and bool(inside.all()):  # one writer, no padding: no mask at all
            i = int(self.filled[0])
            return [(i, None, position - self.parts[i]["start"])]
        plan = []
        for i in self.filled.tolist():
            at = (inside & (part == i)).nonzero().squeeze(1)
            plan.append((i, at, position[at] - self.parts[i]["start"]))
        return plan

    def _read(self, name: str, plan: list[tuple], cells: int) -> torch.Tensor:
        """``[cells, width]`` field ``name`` as ``plan`` places it (zero in the cells no part fills); the host buffer
        pinned when a GPU will read it."""
        dtype, width = self.spec.fields()[name]
        row_bytes = self.maps[name][0].element_size() * width
        for i, _, offsets in plan:  # the blocks these positions lie in, each checked the first time it is read
            self.checked[name][i].check_rows(offsets, row_bytes)
        if plan and plan[0][1] is None:  # every cell from one part: one gather, nothing to zero
            buf = signed_bits(self.maps[name][plan[0][0]])[plan[0][2]].view(DTYPES[dtype])
            return buf.pin_memory() if torch.cuda.is_available() else buf
        buf = torch.zeros(cells, width, dtype=DTYPES[dtype], pin_memory=torch.cuda.is_available())
        for i, at, offsets in plan:
            signed_bits(buf)[at] = signed_bits(self.maps[name][i])[offsets]
        return buf

    def gather(self, row_ids: torch.Tensor, length: int,
               names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """field → ``[B, length, width]`` (every field, or ``names``): each row's positions, zero past its end
        (padding, never a label); no loop over rows."""
        plan = self._plan(*self.cells(row_ids, length))
        return {name: self._read(name, plan, len(row_ids) * length).view(len(row_ids), length, -1)
                for name in (names or tuple(self.spec.fields()))}

    def gather_at(self, cells: tuple[torch.Tensor, torch.Tensor, torch.Tensor], name: str,
                  at: torch.Tensor) -> torch.Tensor:
        """``[len(at), width]``: field ``name`` at the flattened cells ``at`` only of a batch (its :meth:`cells`)."""
        return self._read(name, self._plan(*(c[at] for c in cells)), len(at))

    def reader(self, row_ids: torch.Tensor, length: int, name: str,
               device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        """``read(at)``: field ``name`` ``[len(at), width]`` on ``device`` at the flattened cells ``at`` of a
        ``[B, length]`` batch of these rows, read from the memory map when asked for (a block at a time)."""
        where = self.cells(row_ids, length)  # once per batch
        return lambda at: self.gather_at(where, name, at).to(device, non_blocking=True)


class ReadAhead:
    """Reads from a cache ahead of their use: told the batches that come next (:meth:`expect`), it reads the first on a
    background thread, and each time one is taken (:meth:`get`) starts the next, so a micro-batch's fields are read
    from the memory map while the one before it trains on the GPU (torch's indexing and copies release the GIL). A
    batch it was not told of is read at once; one read runs at a time, so at most two batches' fields are held. Only
    for a GPU (``background``): on a CPU the read and the step share the same cores, and a second thread of torch ops
    only adds an OpenMP team that competes with the step's, so every batch is read when it is asked for."""

    def __init__(self, read: Callable[[Batch], dict[str, torch.Tensor]], background: bool) -> None:
        self.read, self.pool, self.background = read, None, background
        self.queue: deque[Batch] = deque()
        self.pending: tuple[Hashable, Future] | None = None

    @staticmethod
    def key(batch: Batch) -> Hashable:
        return tuple(batch.rows.tolist()), batch.input_ids.shape[1]

    def expect(self, batches: Sequence[Batch]) -> None:
        if not self.background:
            return
        self.queue = deque(b for b in batches if b.rows is not None)
        if self.pending is None:
            self._start_next()

    def _start_next(self) -> None:
        self.pending = None
        if self.queue:
            batch = self.queue.popleft()
            if self.pool is None:
                self.pool = ThreadPoolExecutor(1, thread_name_prefix="kdsweep-cache-read")
            self.pending = (self.key(batch), self.pool.submit(self.read, batch))

    def get(self, batch: Batch) -> dict[str, torch.Tensor]:
        if self.pending is None or self.pending[0] != self.key(batch):
            return self.read(batch)
        future = self.pending[1]
        self._start_next()
        return future.result()


class CachedTeacher(TeacherSource):
    """The teacher's targets for the rows of one split, from its cache (a :class:`~kdsweep.teacher.TeacherSource`);
    the fields of the batches it is told come next are read ahead (:class:`ReadAhead`), but ``full``'s logits: those
    are read from the memory map a block of rows at a time, as the loss uses them (:meth:`full`)."""

    def __init__(self, split: CachedSplit, device: torch.device) -> None:
        self.split, self.device = split, device
        self.tokens_computed, self.tokens_read = 0, 0
        self.ahead = ReadAhead(self._read, background=device.type == "cuda")

    def _read(self, batch: Batch) -> dict[str, torch.Tensor]:
        raw = self.split.gather(batch.rows, batch.input_ids.shape[1])
        if "ids" in raw:
            raw["ids"] = raw["ids"].to(torch.int64)  # uint16 on disk: widened here, where every device can
        return raw

    @property
    def share_key(self) -> tuple:
        return "cache", str(self.split.path), self.split.split, str(self.device)

    def prefetch(self, batches: Sequence[Batch]) -> None:
        if self.split.spec.method != "full":
            self.ahead.expect(batches)

    def full(self, batch: Batch) -> Logits:
        """A ``full`` cache's logits of the batch's cells as :class:`Logits` of "hidden states" that are the cells'
        indices ``[N, 1]``, which the head reads from the memory map: the loss projects a block of rows at a time
        (:meth:`Logits._block_log_probs`), so the block's rows are all it holds of them (a memory map's pages are
        the kernel's file cache, not this process's), never the batch's ``[N, V]``."""
        read = self.split.reader(batch.rows, batch.input_ids.shape[1], "logits", self.device)
        cells = torch.arange(batch.input_ids.numel()).unsqueeze(-1)
        return Logits(hidden=cells, head=lambda at: read(at[:, 0]), rows=self.split.spec.vocab)

    @contextmanager
    def targets(self, batch: Batch) -> Iterator[Targets]:
        if batch.rows is None:
            raise ValueError("a cached teacher needs batches made by Rows.batch (they carry their row indices)")
        self.tokens_read += batch.input_ids.numel()
        spec = self.split.spec
        if spec.method == "full":
            yield self.full(batch)
            return
        raw = self.ahead.get(batch)
        fields = {k: v.to(self.device, non_blocking=True).reshape(-1, v.shape[-1]) for k, v in raw.items()}
        common = {"ids": fields["ids"], "label_logp": fields["label_logp"].squeeze(-1),
                  "temperature": spec.temperature, "vocab": spec.vocab}
        if spec.method == "sample":
            yield Samples(**common, entropy=fields["entropy"].squeeze(-1))
        else:
            yield TopK(**common, logp=fields["logp"], tail_logp=fields["tail_logp"].squeeze(-1))
