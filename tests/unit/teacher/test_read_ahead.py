"""kdsweep.teacher.cached.ReadAhead: for a GPU, a cache's fields for the next micro-batch are read on a background
thread while the current one trains, and what it gives is what a direct read gives; on a CPU (whose cores the step
uses) every batch is read when it is asked for, on the step's own thread."""

import threading

import torch

from kdsweep.data.batch import Batch
from kdsweep.teacher.cached import ReadAhead


def batch(first: int) -> Batch:
    ids = torch.arange(6).reshape(2, 3)
    return Batch(ids, ids, rows=torch.tensor([first, first + 1]))


def test_the_next_batch_is_read_on_another_thread_before_it_is_asked_for():
    reads, gate = [], threading.Event()

    def read(b: Batch) -> dict[str, torch.Tensor]:
        reads.append((int(b.rows[0]), threading.current_thread().name))
        if int(b.rows[0]) == 4:
            gate.set()
        return {"x": b.rows * 10}

    ahead = ReadAhead(read, background=True)
    batches = [batch(0), batch(2), batch(4)]
    ahead.expect(batches)
    got = ahead.get(batches[0])
    assert torch.equal(got["x"], torch.tensor([0, 10]))
    assert torch.equal(ahead.get(batches[1])["x"], torch.tensor([20, 30]))
    assert gate.wait(10)  # the third was started when the second was taken, before anyone asked for it
    assert torch.equal(ahead.get(batches[2])["x"], torch.tensor([40, 50]))
    assert [r for r, _ in reads] == [0, 2, 4]
    assert all(name.startswith("kdsweep-cache-read") for _, name in reads)
    assert ahead.pending is None


def test_a_batch_it_was_not_told_of_is_read_at_once_and_the_expected_one_is_kept():
    reads = []
    ahead = ReadAhead(lambda b: reads.append(int(b.rows[0])) or {"x": b.rows}, background=True)
    expected, other = batch(0), batch(8)
    ahead.expect([expected])
    assert torch.equal(ahead.get(other)["x"], torch.tensor([8, 9]))  # an evaluation between steps, say
    assert torch.equal(ahead.get(expected)["x"], torch.tensor([0, 1]))
    assert sorted(reads) == [0, 8] and ahead.pending is None


def test_without_a_background_read_nothing_is_read_before_it_is_asked_for():
    reads = []
    ahead = ReadAhead(lambda b: reads.append((int(b.rows[0]), threading.current_thread().name)) or {"x": b.rows},
                      background=False)
    batches = [batch(0), batch(2)]
    ahead.expect(batches)
    assert reads == [] and ahead.pool is None and ahead.pending is None
    assert torch.equal(ahead.get(batches[1])["x"], torch.tensor([2, 3]))
    assert torch.equal(ahead.get(batches[0])["x"], torch.tensor([0, 1]))
    assert reads == [(2, threading.current_thread().name), (0, threading.current_thread().name)]


def test_its_thread_ends_with_the_reader_so_a_warm_worker_keeps_none_of_its_trials_threads():
    """A reader's pool thread holds its executor weakly and leaves when the reader (and so its pool) is collected:
    a warm worker's trials, each with its own cached source, leave no thread behind while nothing keeps a reader."""
    import gc
    import time

    def readers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("kdsweep-cache-read")]

    def settled() -> int:  # the readers still running once nothing holds one (gc: an earlier test's too)
        gc.collect()
        deadline = time.monotonic() + 10
        while readers() and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(readers())

    assert settled() == 0
    for _ in range(3):  # three trials' readers, one after the other, as a warm worker runs them
        ahead = ReadAhead(lambda b: {"x": b.rows}, background=True)
        ahead.expect([batch(0), batch(2)])
        ahead.get(batch(0))
        ahead.get(batch(2))
        assert len(readers()) == 1
        del ahead
        assert settled() == 0
