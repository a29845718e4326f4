"""Metadata operations on the shared filesystem while ranks wait for rank 0 (:mod:`kdsweep.distributed.waits`).

A process group of ``--ranks`` gloo ranks laid out as nodes of ``--per-node`` (simulated: one machine) calls
``from_rank0`` once, and rank 0 takes ``--wait`` seconds. The whole group runs under ``strace -f`` (file and stat
calls); every call that names the shared rendezvous directory (``$KDSWEEP_CACHE/rendezvous``) or a node's local
copy (``$KDSWEEP_NODE_TMP/kdsweep-waits-*``, a directory of the run here) is counted, and divided by the wait.
``--python`` runs the group with another interpreter (an earlier commit's venv: the same measurement before a change).

    python benchmarks/wait_poll.py [--ranks 16] [--per-node 8] [--wait 10] [--python PY] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rank(r: int, world: int, per_node: int, wait_s: float, init: str) -> None:
    import torch.distributed as dist

    from kdsweep.distributed.env import DistEnv
    from kdsweep.distributed.waits import from_rank0

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=r, world_size=world)
    env = DistEnv(rank=r, world_size=world, local_world_size=per_node, local_rank=r % per_node, source="local")
    dist.barrier()
    got = from_rank0(env, "wait", lambda: (time.sleep(wait_s), "done")[1])
    assert got == "done"
    dist.barrier()
    dist.destroy_process_group()


def group(world: int, per_node: int, wait_s: float) -> None:
    import torch.multiprocessing as mp

    init = tempfile.mktemp()
    mp.start_processes(rank, args=(world, per_node, wait_s, init), nprocs=world, start_method="spawn")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--wait", type=float, default=10.0)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--group", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.group:
        group(args.ranks, args.per_node, args.wait)
        return
    work = Path(tempfile.mkdtemp(prefix="wait-poll-"))
    env = {**os.environ, "KDSWEEP_CACHE": str(work / "cache"), "KDSWEEP_NODE_TMP": str(work / "tmp"),
           "OMP_NUM_THREADS": "1"}
    (work / "tmp").mkdir()
    trace = work / "trace.txt"
    cmd = ["strace", "-f", "-qq", "-e", "trace=%file,%stat", "-o", str(trace), args.python, __file__, "--group",
           "--ranks", str(args.ranks), "--per-node", str(args.per_node), "--wait", str(args.wait)]
    subprocess.run(cmd, env=env, check=True, cwd=work)
    shared = re.compile(re.escape(str(work / "cache" / "rendezvous")))
    local = re.compile(re.escape(str(work / "tmp" / "kdsweep-waits-")))
    lines = trace.read_text().splitlines()
    counts = {"shared": sum(bool(shared.search(line)) for line in lines),
              "local": sum(bool(local.search(line)) for line in lines)}
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "python": args.python, "ranks": args.ranks, "per_node": args.per_node, "wait_s": args.wait,
              "calls": counts, "shared_per_s": round(counts["shared"] / args.wait, 1),
              "local_per_s": round(counts["local"] / args.wait, 1), "command": " ".join(sys.argv)}
    print(json.dumps(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        runs = json.loads(args.out.read_text()) if args.out.exists() else []
        args.out.write_text(json.dumps([*runs, result], indent=1))


if __name__ == "__main__":
    main()
