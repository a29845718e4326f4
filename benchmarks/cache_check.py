"""What checking a shared artefact against its checksums costs (kdsweep.data.integrity), on a 1 GB teacher cache file.

A raw cache file of ``--gb`` GB (``sample``'s ids: 24 bytes per position, k=12 uint16) is written twice, through a
plain file and through :class:`~kdsweep.data.integrity.SummedFile` (the build's cost of the sidecar). Then, with the
file in the page cache (what a machine's second reader sees; the first reader pays the disk either way):

- ``open_ms``: a job opening the file (:class:`~kdsweep.data.integrity.CheckedFile`: its ``stat``, its sidecar read);
- ``check_all_s``: checking every block (what a job reading all of it pays once; the GB/s beside it);
- a trial's reads: ``--batches`` batches of 8 rows of 512 positions at random places, gathered from the memory map as
  the cache's reader does, without and with the blocks they touch checked the first time (a fresh process's reads).

Medians of ``--repeats`` interleaved repeats; printed and saved to ``benchmarks/results/cache_check.json``.

    python benchmarks/cache_check.py [--gb 1] [--batches 400] [--repeats 3] [--dir /tmp] [--out ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kdsweep.data.integrity import BLOCK, CheckedFile, SummedFile, forget

REPO = Path(__file__).resolve().parents[1]
ROW_BYTES = 24  # a sample cache's ids at k=12, uint16


def write(path: Path, gb: float, summed: bool) -> float:
    g = torch.Generator().manual_seed(0)  # the same bytes whichever way the file is written (its sidecar holds)
    chunk = torch.randint(0, 2**16, (BLOCK // 2,), generator=g, dtype=torch.int32).to(torch.uint16)
    chunk = chunk.view(torch.uint8).numpy()
    t0 = time.perf_counter()
    f = SummedFile(path) if summed else open(path, "wb")
    for _ in range(int(gb * 2**30) // len(chunk)):
        f.write(chunk)
    f.close()
    return time.perf_counter() - t0


def batches(positions: int, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, positions - 512, (n, 8), generator=g)
    return [(s[:, None] + torch.arange(512)[None, :]).reshape(-1) for s in starts]


def reads(data: torch.Tensor, batches_: list[torch.Tensor], checked: CheckedFile | None) -> float:
    t0 = time.perf_counter()
    for at in batches_:
        if checked is not None:
            checked.check_rows(at, ROW_BYTES)
        data[at].sum()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--batches", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "cache_check.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="kdsweep-cache-check-", dir=args.dir))
    path = work / "train.ids.0"
    runs: dict[str, list[float]] = {k: [] for k in ("write_plain_s", "write_summed_s", "open_ms", "check_all_s",
                                                   "reads_plain_s", "reads_checked_s")}
    try:
        for r in range(args.repeats):
            for summed in ((False, True) if r % 2 == 0 else (True, False)):
                runs["write_summed_s" if summed else "write_plain_s"].append(write(path, args.gb, summed))
            size = path.stat().st_size
            opens = []
            for _ in range(20):
                t0 = time.perf_counter()
                CheckedFile(path)
                opens.append((time.perf_counter() - t0) * 1e3)
            runs["open_ms"].append(statistics.median(opens))
            forget()  # each measurement as a fresh process's
            t0 = time.perf_counter()
            CheckedFile(path).check_all()
            runs["check_all_s"].append(time.perf_counter() - t0)
            data = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
            data = data[: size // ROW_BYTES * ROW_BYTES].view(-1, ROW_BYTES)
            todo = batches(size // ROW_BYTES, args.batches, seed=r)
            for checked in ((False, True) if r % 2 == 0 else (True, False)):
                forget()
                runs["reads_checked_s" if checked else "reads_plain_s"].append(
                    reads(data, todo, CheckedFile(path) if checked else None))
            del data
    finally:
        for p in work.iterdir():
            p.unlink()
        work.rmdir()
    med = {k: statistics.median(v) for k, v in runs.items()}
    gb = size / 1e9
    touched = args.batches * 8 * 512 * ROW_BYTES
    result = {
        "file_gb": gb, "block_bytes": BLOCK, "row_bytes": ROW_BYTES, **med,
        "check_gb_per_s": gb / med["check_all_s"], "sidecar_build_overhead": med["write_summed_s"] / med["write_plain_s"],
        "reads": {"batches": args.batches, "rows_per_batch": 8, "positions_per_row": 512, "bytes_read": touched,
                  "checked_over_plain": med["reads_checked_s"] / med["reads_plain_s"]},
        "runs": runs,
    }
    print(f"{gb:.2f} GB file: open {med['open_ms']:.2f} ms; every block checked in {med['check_all_s']:.2f} s "
          f"({result['check_gb_per_s']:.2f} GB/s); written {med['write_plain_s']:.2f} s plain, "
          f"{med['write_summed_s']:.2f} s with its sidecar; a trial's {args.batches} batches read in "
          f"{med['reads_plain_s']:.2f} s unchecked, {med['reads_checked_s']:.2f} s checked", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
        "cpus": os.cpu_count(), "command": " ".join(sys.argv), "result": result}, indent=1))


if __name__ == "__main__":
    main()
