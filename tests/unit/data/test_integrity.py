"""Checksummed artefacts (kdsweep.data.integrity): each file's sidecar is written with it; a changed byte, a short
file or a missing one is one line naming the file and the fix, raised before the bytes are used; a teacher cache's
blocks are checked by the rows a batch reads, each block once per process."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest
import torch

from kdsweep.config.base import JobError
from kdsweep.data import integrity
from kdsweep.data.rows import Rows
from kdsweep.data.views import View, ViewTable
from kdsweep.teacher.aligned_rows import AlignedRows, RowPlan


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(integrity, "BLOCK", 64)
    return 64


def test_the_sidecar_holds_each_block_s_crc_however_the_bytes_were_written(tmp_path, small_blocks):
    data = bytes(range(256)) * 3 + b"tail"  # 772 bytes: 12 whole blocks and a short one
    written = integrity.SummedFile(tmp_path / "a")
    for piece in (data[:5], data[5:200], data[200:201], data[201:]):  # pieces across block boundaries
        written.write(piece)
    written.close()
    (tmp_path / "b").write_bytes(data)
    integrity.sum_file(tmp_path / "b")
    a, b = (json.loads(integrity.sums_path(tmp_path / n).read_text()) for n in "ab")
    assert a == b
    assert a["size"] == 772 and a["block"] == 64
    crcs = [int.from_bytes(bytes.fromhex(a["crc32"])[i:i + 4], "little") for i in range(0, 13 * 4, 4)]
    assert len(a["crc32"]) == 13 * 8  # 13 blocks, the last of 4 bytes
    assert crcs == [zlib.crc32(data[i:i + 64]) for i in range(0, 772, 64)]


def _file(tmp_path: Path, rows: int, row_bytes: int) -> Path:
    path = tmp_path / "train.ids.0"
    f = integrity.SummedFile(path)
    f.write(torch.arange(rows * row_bytes, dtype=torch.int64).to(torch.uint8).numpy())
    f.close()
    return path


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("row_bytes", [24, 150])  # rows inside a block or across one; rows wider than a block
def test_a_changed_byte_is_refused_by_the_rows_whose_blocks_hold_it_and_only_by_them(tmp_path, small_blocks,
                                                                                      row_bytes):
    path = _file(tmp_path, 40, row_bytes)
    bad = 5 * 64 + 10  # a byte of block 5
    _flip(path, bad)
    checked = integrity.CheckedFile(path)
    clear = [r for r in range(40) if not (r * row_bytes // 64 <= 5 <= ((r + 1) * row_bytes - 1) // 64)]
    checked.check_rows(torch.tensor(clear), row_bytes)  # every row whose bytes lie in other blocks
    hit = bad // row_bytes
    for row in {hit, *(r for r in range(40) if r not in clear)}:
        with pytest.raises(JobError) as e:
            integrity.CheckedFile(path).check_rows(torch.tensor([row]), row_bytes)
        line = str(e.value)
        assert "\n" not in line and f"{path} has changed bytes in block 5 of" in line
        assert f"delete {tmp_path} and the next job that needs it builds it again" in line


def test_each_block_is_checked_once_per_process(tmp_path, small_blocks):
    path = _file(tmp_path, 10, 24)
    integrity.CheckedFile(path).check_rows(torch.tensor([0, 1, 2]), 24)  # blocks 0 and 1, by one reader
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF  # block 0 goes bad in place (bit rot: same size and mtime) after this process checked it
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    integrity.CheckedFile(path).check_rows(torch.tensor([0]), 24)  # another reader here (a warm worker's next trial)
    _flip(path, 130)  # block 2, which no reader here has checked yet
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(JobError, match="block 2 of 4"):
        integrity.CheckedFile(path).check_rows(torch.tensor([5]), 24)  # row 5: bytes 120-143, blocks 1 and 2
    integrity.forget()  # another process
    with pytest.raises(JobError, match="block 0 of 4"):
        integrity.CheckedFile(path).check_rows(torch.tensor([0]), 24)


def test_a_short_or_missing_file_is_refused_when_it_is_opened(tmp_path, small_blocks):
    path = _file(tmp_path, 10, 24)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(JobError, match=r"train.ids.0 is 200 bytes, 240 when it was written \(truncated\)"):
        integrity.CheckedFile(path)
    path.unlink()
    with pytest.raises(JobError, match=r"train.ids.0 is missing: the artefact .* is damaged"):
        integrity.CheckedFile(path)


def _rows() -> Rows:
    views = [[View("a b", [(0, 1)], [7, 8], [(0, 1)])], [View("c", [(0, 1)], [9], [(0, 1)])]]
    return Rows.from_rows([[1, 2, 3], [4, 5]], [[2, 3, -100], [5, -100]], None, [3, 2], pad_id=0,
                          ignore_index=-100, views=views)


def _aligned() -> AlignedRows:
    plan = RowPlan(spans=torch.tensor([[0, 1, 0, 1]], dtype=torch.int32), teacher_ids=torch.tensor([5, 6],
                   dtype=torch.int32), teacher_positions=torch.tensor([0, 1], dtype=torch.int32), dropped=0,
                   unaligned=1)
    return AlignedRows.of([plan, plan], pad_id=0)


ARTEFACTS = {  # each .pt artefact: how it is written and read, and a value read back to compare
    "rows": (lambda p: _rows().save(p), Rows.load, lambda r: (r.input_ids.tolist(), r.views.t["text"].tolist())),
    "aligned rows": (lambda p: _aligned().save(p), lambda p: AlignedRows.load(p, 0), lambda a: a.t["spans"].tolist()),
}


@pytest.mark.parametrize("kind", ARTEFACTS)
@pytest.mark.parametrize("damage", ["changed", "truncated", "missing"])
def test_a_damaged_pt_artefact_is_one_line_before_it_is_read(tmp_path, kind, damage):
    save, load, value = ARTEFACTS[kind]
    path = tmp_path / "train.pt"
    save(path)
    assert value(load(path)) == value(load(path))  # intact: read (and read again, unchecked this time)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert all(f"{n}.sums" in files for n in files if not n.endswith(".sums"))  # every file has its sidecar
    fresh = tmp_path / "copy" / "train.pt"  # a copy this process has not checked
    fresh.parent.mkdir()
    for p in tmp_path.glob("train.*"):
        (fresh.parent / p.name).write_bytes(p.read_bytes())
    if damage == "changed":
        _flip(fresh, fresh.stat().st_size // 2)
    elif damage == "truncated":
        fresh.write_bytes(fresh.read_bytes()[:-7])
    else:
        fresh.unlink()
    with pytest.raises(JobError) as e:
        load(fresh)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{fresh} ")
    assert {"changed": "has changed bytes", "truncated": "(truncated)", "missing": "is missing"}[damage] in line
    assert f"delete {fresh.parent} and the next job" in line


def test_an_artefact_built_before_checksums_is_read_with_a_warning(tmp_path, caplog):
    path = tmp_path / "train.pt"
    _rows().save(path)
    integrity.sums_path(path).unlink()
    integrity.sums_path(path.with_suffix(".views.pt")).unlink()
    assert Rows.load(path).input_ids.tolist() == [1, 2, 3, 4, 5]
    assert "has no checksums" in caplog.text and "read unchecked" in caplog.text


def test_a_view_table_keeps_its_own_sidecar(tmp_path):
    table = ViewTable.of([[View("x", [(0, 1)], [1], [(0, 1)])]])
    table.save(tmp_path / "v.pt")
    _flip(tmp_path / "v.pt", 100)
    with pytest.raises(JobError, match="v.pt has changed bytes"):
        ViewTable.load(tmp_path / "v.pt")


def test_an_artefact_s_json_missing_or_not_json_is_one_line(tmp_path):
    from kdsweep.teacher.cache import read_meta

    with pytest.raises(JobError, match=r"meta.json is missing: the artefact .* is damaged"):
        read_meta(tmp_path)
    (tmp_path / "meta.json").write_text('{"spec": {"method": "sam')  # cut short
    with pytest.raises(JobError, match=r"meta.json is not JSON: the artefact .* delete "):
        read_meta(tmp_path)
