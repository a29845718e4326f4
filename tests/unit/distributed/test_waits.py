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

