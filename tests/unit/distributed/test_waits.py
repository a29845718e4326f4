"""What rank 0 alone waits on takes as long as it takes: its peers wait for its word in a file, not a collective."""

import os
import time

from helpers import gloo_ranks

TIMEOUT_S = 2


def _ranks(rank: int, out: str) -> None:
    import torch.distributed as dist

    from kdsweep.distributed.env import DistEnv
    from kdsweep.distributed.waits import from_rank0

    env = DistEnv(rank=rank, world_size=2, local_world_size=2, source="local")

    def slow() -> str:
        time.sleep(2.5 * TIMEOUT_S)  # longer than any collective of this group may wait
        return "hashed"

    got = from_rank0(env, "hash the teacher's files", slow)
    t = __import__("torch").ones(1)
    dist.all_reduce(t)  # the group still works: nobody timed out
    try:
        from_rank0(env, "take the lock", lambda: (_ for _ in ()).throw(OSError("disk gone")))
        error = None
    except BaseException as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(f"{got}|{error}|{t.item()}")


def test_peers_wait_longer_than_the_collective_timeout_and_get_rank0s_value_or_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KDSWEEP_CACHE", str(tmp_path / "cache"))  # the ranks' rendezvous directory
    gloo_ranks(_ranks, str(tmp_path), tmp_path=tmp_path, timeout_s=TIMEOUT_S)
    rank0, rank1 = ((tmp_path / f"rank{r}.txt").read_text().split("|") for r in (0, 1))
    assert rank0[0] == rank1[0] == "hashed" and rank0[2] == rank1[2] == "2.0"
    assert rank0[1] == "OSError: disk gone"
    assert rank1[1] == "RuntimeError: rank 0 failed to take the lock: OSError: disk gone"



def _nodes(rank: int, out: str) -> None:
    import pathlib

    from kdsweep.distributed import waits
    from kdsweep.distributed.env import DistEnv

    env = DistEnv(rank=rank, world_size=4, local_world_size=2, local_rank=rank % 2, source="local")
    shared, looks, stat = str(waits.rendezvous_root()), [], pathlib.Path.stat

    def counted(self, *args, **kw):  # every look at a file (exists() stats too)
        if str(self).startswith(shared):
            looks.append(str(self))
        return stat(self, *args, **kw)

    pathlib.Path.stat = counted
    got = waits.from_rank0(env, "sleep", lambda: (time.sleep(3), "done")[1])
    pathlib.Path.stat = stat
    with open(os.path.join(out, f"nodes{rank}.txt"), "w") as f:
        f.write(f"{got}|{len(looks)}")


def test_one_rank_per_node_looks_at_the_shared_directory_backing_off_and_its_node_waits_on_it(tmp_path, monkeypatch):
    """4 ranks as 2 nodes of 2, rank 0 busy 3 s: node 1's first rank polls the shared directory (backing off to a
    look a second: about a dozen looks, where every 50 ms would be 120), ranks 1 and 3 never look at it (they wait on
    their node's local copy), and every rank gets rank 0's value."""
    monkeypatch.setenv("KDSWEEP_CACHE", str(tmp_path / "cache"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("KDSWEEP_NODE_TMP", str(tmp_path / "tmp"))  # each node's local copies, here
    gloo_ranks(_nodes, str(tmp_path), tmp_path=tmp_path, nprocs=4, timeout_s=TIMEOUT_S)
    got = [(tmp_path / f"nodes{r}.txt").read_text().split("|") for r in range(4)]
    assert [g[0] for g in got] == ["done"] * 4
    looks = [int(g[1]) for g in got]
    assert looks[1] == looks[3] == 0 and 0 < looks[2] <= 30, looks
    nodes = sorted(p.name.rsplit("-", 1)[1] for p in (tmp_path / "tmp").glob("kdsweep-waits-*"))
    assert nodes == ["node0", "node1"]  # rank 0's copy for its node, node 1's first rank's for its own


def _apart(rank: int, out: str, own: str) -> None:
    from kdsweep.distributed import waits
    from kdsweep.distributed.env import DistEnv

    if rank == 3:  # a rank whose node directory is not its node's (a per-process temp dir): its copy never comes
        os.environ["KDSWEEP_NODE_TMP"] = own
    waits.FALLBACK_S = 0.5
    env = DistEnv(rank=rank, world_size=4, local_world_size=2, local_rank=rank % 2, source="local")
    got = waits.from_rank0(env, "sleep", lambda: (time.sleep(2), "done")[1])
    with open(os.path.join(out, f"apart{rank}.txt"), "w") as f:
        f.write(got)


def test_a_rank_whose_node_copy_never_comes_hears_rank_0_from_the_shared_file(tmp_path, monkeypatch):
    monkeypatch.setenv("KDSWEEP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KDSWEEP_NODE_TMP", str(tmp_path / "node"))
    gloo_ranks(_apart, str(tmp_path), str(tmp_path / "elsewhere"), tmp_path=tmp_path, nprocs=4, timeout_s=TIMEOUT_S)
    assert [(tmp_path / f"apart{r}.txt").read_text() for r in range(4)] == ["done"] * 4
