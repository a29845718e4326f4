"""Checksums of the artefacts jobs share: a teacher cache, a tokenization cache, the aligned rows.

Every file ``F`` of one is written with a sidecar ``F.sums`` (JSON: its size, the block size, and one CRC-32 per block
of :data:`BLOCK` bytes, as the hex of their little-endian uint32s), inside the artefact's temp directory before it is
renamed into place (:func:`kdsweep.data.cache.built_once`). Whoever reads the artefact checks, when it opens a file,
that the file is there and has the size it was written with (one ``stat`` and the sidecar's read), and checks each block
against its checksum the first time this process reads the block (:class:`CheckedFile`): a teacher cache by the
positions a batch gathers (:meth:`CheckedFile.check_rows`), so a terabyte cache is never read whole to check it; a
``.pt`` file (the tokenization cache's rows and their views, the aligned rows, which torch maps whole) all of it when it
is opened (:func:`load`), once per process. A changed byte, a short file or a missing one is one line (a
:class:`~kdsweep.config.base.JobError`) naming the file and what to do (delete the artefact: the next job that needs it
builds it again), raised before the bytes are used: never trained on.

Cost: CRC-32 (zlib) runs at about 4 GB/s on one core of this machine, so checking what a trial reads adds about a
quarter of a second per GB it reads, once per process; opening checks only sizes. An artefact built before this module
(no sidecars) is read unchecked, with a warning once per file. CRC-32 catches changed and lost bytes, not deliberate
tampering.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kdsweep.config.base import JobError

log = logging.getLogger(__name__)

BLOCK = 1 << 20
"""Bytes per checksummed block: a first read of a few bytes checks the MiB around them (about 0.25 ms); a terabyte
file's sidecar holds 4 MB of checksums."""
SUFFIX = ".sums"


def sums_path(path: Path) -> Path:
    return path.with_name(path.name + SUFFIX)


class Summer:
    """CRC-32 of each :data:`BLOCK` of a stream of bytes, as they are written."""

    def __init__(self) -> None:
        self.size, self.sums, self.crc, self.fill = 0, [], 0, 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(BLOCK - self.fill, len(view))
            self.crc = zlib.crc32(view[:take], self.crc)
            self.fill, self.size, view = self.fill + take, self.size + take, view[take:]
            if self.fill == BLOCK:
                self.sums.append(self.crc)
                self.crc, self.fill = 0, 0

    def write(self, path: Path) -> None:
        """The sidecar of the file these bytes were written to."""
        sums = self.sums + ([self.crc] if self.fill else [])
        sums_path(path).write_text(json.dumps({"size": self.size, "block": BLOCK,
                                               "crc32": np.array(sums, dtype="<u4").tobytes().hex()}))


class SummedFile:
    """A file opened for writing whose sidecar is written when it is closed."""

    def __init__(self, path: Path) -> None:
        self.path, self.file, self.summer = path, open(path, "wb"), Summer()

    def write(self, data: Any) -> None:
        self.summer.update(data)
        self.file.write(data)

    def close(self) -> None:
        self.file.close()
        self.summer.write(self.path)


def sum_file(path: Path) -> None:
    """Write the sidecar of a file already written (read back once, a block at a time)."""
    summer = Summer()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            summer.update(block)
    summer.write(path)


def damaged(path: Path, why: str) -> JobError:
    """The one line for a damaged file of the artefact in ``path``'s directory."""
    return JobError(f"{path} {why}: the artefact {path.parent} is damaged (refused before any of it was used); "
                    f"delete {path.parent} and the next job that needs it builds it again")


class CheckedFile:
    """A file of a shared artefact, checked against its sidecar: present with its size when opened (here), each
    block the first time this process reads it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            raise damaged(path, "is missing") from None
        try:
            sums = json.loads(sums_path(path).read_text())
        except FileNotFoundError:
            _warn_unchecked(path)
            self.crcs = np.zeros(0, dtype="<u4")
            self.block, self.done = BLOCK, torch.ones(0, dtype=torch.bool)
            return
        except (ValueError, KeyError):
            raise damaged(sums_path(path), "is not the JSON of a file's checksums") from None
        if stat.st_size != sums["size"]:
            raise damaged(path, f"is {stat.st_size} bytes, {sums['size']} when it was written "
                                f"({'truncated' if stat.st_size < sums['size'] else 'grown'})")
        self.crcs, self.block = np.frombuffer(bytes.fromhex(sums["crc32"]), dtype="<u4"), sums["block"]
        # the blocks this process checked: every reader of this version of the file here shares them
        self.done = _CHECKED.setdefault((str(path), stat.st_size, stat.st_mtime_ns),
                                        torch.zeros(len(self.crcs), dtype=torch.bool))

    def check_rows(self, rows: torch.Tensor, row_bytes: int) -> None:
        """Check the blocks holding rows ``rows`` (int64 indices) of ``row_bytes`` bytes each, not checked yet."""
        if not len(rows) or bool(self.done.all()):  # no sidecar (done is empty), or every block checked already
            return
        first = rows * row_bytes // self.block
        last = ((rows + 1) * row_bytes - 1) // self.block
        spans = last - first + 1
        blocks = first.repeat_interleave(spans) + torch.arange(int(spans.sum())) - \
            (spans.cumsum(0) - spans).repeat_interleave(spans)
        self._check(torch.unique(blocks))

    def check_all(self) -> None:
        self._check(torch.arange(len(self.crcs)))

    def _check(self, blocks: torch.Tensor) -> None:
        todo = blocks[~self.done[blocks]].tolist()
        if not todo:
            return
        with open(self.path, "rb") as f:
            for i in todo:
                f.seek(i * self.block)
                data = f.read(self.block)
                if zlib.crc32(data) != self.crcs[i]:
                    raise damaged(self.path, f"has changed bytes in block {i} of {len(self.crcs)} (bytes "
                                             f"{i * self.block}-{i * self.block + len(data) - 1}: not the checksum "
                                             "written with it)")
        self.done[todo] = True


def read_artefact_json(path: Path) -> Any:
    """An artefact's JSON file (a teacher cache's ``meta.json``, a tokenization cache's ``stats.json``); one line
    when it is missing or not JSON."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise damaged(path, "is missing") from None
    except ValueError:
        raise damaged(path, "is not JSON") from None


_WARNED: set[str] = set()
_CHECKED: dict[tuple[str, int, int], torch.Tensor] = {}
"""(path, size, mtime) → which of its blocks this process checked: a warm worker's later trials do not check them
again."""


def forget() -> None:
    """Forget which blocks this process checked: every block is checked again when next read, as in a fresh
    process."""
    _CHECKED.clear()


def _warn_unchecked(path: Path) -> None:
    if str(path) not in _WARNED:
        _WARNED.add(str(path))
        log.warning("%s has no checksums (%s%s: built before kdsweep kept them); read unchecked (delete %s to have it "
                    "built again with them)", path, path.name, SUFFIX, path.parent)


def save(obj: Any, path: Path) -> None:
    """``torch.save`` and the file's sidecar."""
    torch.save(obj, path)
    sum_file(path)


def load(path: Path) -> Any:
    """``torch.load`` memory-mapped, after the whole file is checked against its sidecar (once per process and
    version of the file)."""
    CheckedFile(path).check_all()
    return torch.load(path, mmap=True, weights_only=True)


__all__ = ["BLOCK", "CheckedFile", "SUFFIX", "Summer", "SummedFile", "damaged", "forget", "load",
           "read_artefact_json", "save", "sum_file", "sums_path"]
