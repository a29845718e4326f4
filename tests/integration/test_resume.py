"""kill -9 of a running job at a random step, rerun of the same command: it ends exactly as an uninterrupted run."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from conftest import QUIET, kdsweep, read_metrics, read_run

pytestmark = pytest.mark.slow

ARGS = ["train.max_steps=12", "train.eval_every=4", "checkpoint.save_every=3", "checkpoint.export_merged=false", *QUIET]


def _wait_for_step(run_dir, step, proc, deadline):
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the job ended before step {step}: {proc.stderr.read()}")
        path = run_dir / "metrics.jsonl"
        if path.exists():
            rows = [r for r in read_metrics_safe(path) if r["kind"] == "train"]
            if rows and rows[-1]["step"] >= step:
                return rows[-1]["step"]
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in time")


def read_metrics_safe(path):
    import json

    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            pass
    return out


def test_kill_9_then_rerun_gives_the_uninterrupted_objective(tmp_path, zoo_dirs):
    reference = tmp_path / "reference"
    kdsweep(*ARGS, f"hydra.run.dir={reference}", cwd=tmp_path)
    expected = read_run(reference)["objective"]

    kill_at = random.Random(time.time_ns()).randint(4, 10)
    print(f"killing at step {kill_at}")
    run_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "kdsweep", *ARGS, f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    reached = _wait_for_step(run_dir, kill_at, proc, time.time() + 300)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert read_run(run_dir)["status"] == "running"  # it really died mid-run
    assert not (run_dir / "final").exists()

    kdsweep(*ARGS, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    record = read_run(run_dir)
    assert record["status"] == "completed" and record["attempts"] == 2
    # resumed from the last complete checkpoint: the one before the last logged step at least (a step's row is
    # written before its checkpoint, so the kill may have hit that checkpoint half-written)
    assert record["start_step"] % 3 == 0 and 3 * ((reached - 1) // 3) <= record["start_step"] < 12
    assert record["objective"] == pytest.approx(expected, abs=1e-6), (kill_at, reached, record["start_step"])
    steps = [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert steps == list(range(1, 13)), "the history must have every step once"
    ref_rows = [r for r in read_metrics(reference) if r["kind"] == "train"]
    got_rows = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert [round(r["loss"], 6) for r in got_rows] == [round(r["loss"], 6) for r in ref_rows]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000009", "step_00000012"]


FULL_DISK = ["train=smoke", "checkpoint.save_every=2", "checkpoint.keep_last=1", "checkpoint.export_adapter=false",
             "checkpoint.export_merged=false", *QUIET]


def _tree_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_a_disk_that_fills_at_a_checkpoint_is_one_line_failed_no_temp_directory_and_a_rerun_resumes(tmp_path):
    """The run directory on a small filesystem (a tmpfs) with room for one checkpoint and the run's records: the
    second checkpoint (step 4) cannot be written. The job ends in one line (which checkpoint, what it needs, what is
    free, the fix), exit 1, no traceback; run.json says failed with that line; no temp directory is left; once there
    is room, the same command resumes from step 2 and ends with the uninterrupted run's objective."""
    reference = tmp_path / "reference"
    kdsweep(*FULL_DISK, f"hydra.run.dir={reference}", cwd=tmp_path)
    checkpoint = _tree_bytes(next((reference / "checkpoints").iterdir()))
    records = _tree_bytes(reference) - checkpoint
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(small)], check=True)  # CI runs as root
    try:
        filler = small / "filler"
        room = records * 2 + checkpoint * 3 // 2 + 256 * 1024  # one checkpoint and the records fit, two do not
        subprocess.run(["fallocate", "-l", str(os.statvfs(small).f_bavail * os.statvfs(small).f_frsize - room),
                        str(filler)], check=True)
        run_dir = small / "run"
        proc = kdsweep(*FULL_DISK, f"hydra.run.dir={run_dir}", cwd=tmp_path, check=False)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert lines[-1].startswith("kdsweep: error: no space left to write the checkpoint step_00000004"), lines
        assert "it resumes from step_00000002" in lines[-1] and "MB is free in" in lines[-1]
        record = read_run(run_dir)
        assert record["status"] == "failed" and "no space left to write the checkpoint" in record["error"]
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002"]  # no .tmp-step_
        filler.unlink()
        kdsweep(*FULL_DISK, f"hydra.run.dir={run_dir}", cwd=tmp_path)
        resumed = read_run(run_dir)
        assert resumed["status"] == "completed" and resumed["start_step"] == 2
        assert resumed["objective"] == pytest.approx(read_run(reference)["objective"], abs=1e-6)
    finally:
        subprocess.run(["umount", str(small)], check=False)
