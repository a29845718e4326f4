"""Every collective torch.distributed offers is counted with its bytes on the wire (kdsweep.distributed.comm), and
none is entered after a failure: 2 gloo ranks, one call of each kind, against the formulas worked out by hand."""

import json
import os
import time

from helpers import gloo_ranks

FLOATS = 1000  # each collective's tensor: 4,000 bytes
B = 4 * FLOATS


def _ranks(rank: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from kdsweep.distributed import comm

    comm.install(2, rank)
    t = lambda n=FLOATS: torch.ones(n)  # noqa: E731
    calls = {
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(t(2 * FLOATS), t()),
        "all_gather": lambda: dist.all_gather([t(), t()], t()),
        "functional_all_gather": lambda: (funcol.all_gather_tensor(t(), 0, dist.group.WORLD) + 0).sum(),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(t(), t(2 * FLOATS)),
        "all_reduce": lambda: dist.all_reduce(t()),
        "functional_all_reduce": lambda: (funcol.all_reduce(t(), "sum", dist.group.WORLD) + 0).sum(),
        "all_to_all_single": lambda: dist.all_to_all_single(t(), t()),
        "broadcast": lambda: dist.broadcast(t(), src=0),
        "gather": lambda: dist.gather(t(), [t(), t()] if rank == 0 else None, dst=0),
        "scatter": lambda: dist.scatter(t(), [t(), t()] if rank == 0 else None, src=0),
        "reduce": lambda: dist.reduce(t(), dst=0),
        "send_recv": lambda: dist.send(t(), dst=1) if rank == 0 else dist.recv(t(), src=0),
        "gather_object": lambda: dist.gather_object("x" * 100, [None, None] if rank == 0 else None, dst=0),
        "barrier": lambda: dist.barrier(),
    }
    counted = {}
    for name, call in calls.items():
        before = comm.TALLY.copy()
        call()
        tally = comm.TALLY.since(before).record().get("other", {})
        counted[name] = {kind: [c["calls"], c["bytes"]] for kind, c in tally.items()}
    refused = {}
    comm.mark_failed("rank 1 failed (a test)")
    for name, call in (("gather_object", calls["gather_object"]),
                       ("scatter_object_list", lambda: dist.scatter_object_list([None], ["a", "b"], src=0))):
        t0 = time.monotonic()
        try:
            call()
            refused[name] = None
        except comm.CollectiveRefused as e:
            refused[name] = [str(e), time.monotonic() - t0]
    comm.install(2, rank)  # a new job's mark: the helper's last barrier is not refused
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"counted": counted, "refused": refused}, f)


def test_each_collective_is_counted_by_the_formula_and_refused_after_a_failure(tmp_path):
    gloo_ranks(_ranks, str(tmp_path), tmp_path=tmp_path, timeout_s=30)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # [calls, bytes per rank] on 2 ranks, each tensor 4,000 bytes (ring: (n-1)/n; rooted: the root n-1 tensors)
    both = {
        "all_gather_into_tensor": {"all_gather": [1, 4000]},  # (n-1)/n of its 8,000-byte output
        "all_gather": {"all_gather": [1, 4000]},
        "functional_all_gather": {"all_gather": [1, 4000]},  # its 4,000-byte shard is half of the output
        "reduce_scatter_tensor": {"reduce_scatter": [1, 4000]},  # (n-1)/n of its 8,000-byte input
        "all_reduce": {"all_reduce": [1, 4000]},  # 2(n-1)/n
        "functional_all_reduce": {"all_reduce": [1, 4000]},
        "all_to_all_single": {"all_to_all": [1, 2000]},  # (n-1)/n of its input goes to the other rank
        "gather": {"gather": [1, 4000]},  # the root receives n-1 tensors, the other rank sends its one
        "scatter": {"scatter": [1, 4000]},
        "reduce": {"reduce": [1, 4000]},
        "barrier": {"barrier": [1, 0]},
    }
    for name, want in both.items():
        assert r0["counted"][name] == want and r1["counted"][name] == want, (name, r0["counted"][name])
    assert r0["counted"]["broadcast"] == {"broadcast": [1, 0]} and r1["counted"]["broadcast"] == {"broadcast": [1, B]}
    assert r0["counted"]["send_recv"] == {"send": [1, B]} and r1["counted"]["send_recv"] == {"recv": [1, B]}
    # gather_object: the all-gather of the pickles' sizes and the gather of the pickles
    assert set(r0["counted"]["gather_object"]) == {"all_gather", "gather"}
    assert r0["counted"]["gather_object"]["gather"][1] > 100  # the root received rank 1's pickle
    for r in (r0, r1):
        for name, (error, seconds) in r["refused"].items():
            assert error.startswith("no ") and "after a failure: rank 1 failed (a test)" in error and seconds < 1, name


def _late_error(rank: int, out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from kdsweep.distributed import comm

    comm.install(2, rank)
    quick = dist.new_group(timeout=datetime.timedelta(seconds=2))  # its collectives give up after 2 s
    seen = {}
    if rank == 0:  # rank 1 never joins this all-reduce: it fails, but only when its result is waited on
        pending = funcol.all_reduce(torch.ones(4), "sum", quick)
        seen["after_call"] = comm.failed()
        try:
            (pending + 0).sum()
            seen["wait"] = None
        except Exception as e:  # noqa: BLE001 - gloo's own error type varies
            seen["wait"] = type(e).__name__
        seen["after_wait"] = comm.failed()
        try:
            dist.all_reduce(torch.ones(1))
            seen["next"] = None
        except comm.CollectiveRefused as e:
            seen["next"] = str(e)
        with open(os.path.join(out, "late.json"), "w") as f:
            json.dump(seen, f)
        comm.install(2, rank)  # a new job's mark: the helper's last barrier is not refused
    else:
        time.sleep(4)


def test_a_functional_collectives_error_raised_at_its_wait_marks_the_process_failed(tmp_path):
    gloo_ranks(_late_error, str(tmp_path), tmp_path=tmp_path, timeout_s=30)
    seen = json.loads((tmp_path / "late.json").read_text())
    assert seen["after_call"] is None and seen["wait"] is not None, seen  # the call returned; the wait raised
    assert seen["after_wait"].startswith("a functional collective failed when waited on"), seen
    assert seen["next"].startswith("no all_reduce after a failure: a functional collective failed"), seen
