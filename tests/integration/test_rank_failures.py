"""One rank of a 2-rank job or warm worker fails: no rank enters another collective, and nothing is lost.

A rank that raises mid-trial (``KDSWEEP_TEST_RAISE_AT``) and a rank killed with kill -9 (what the OOM killer does):
with ``dist.timeout_s=600`` every rank of the worker is gone within a minute. The raised error is the trial's own:
it is FAIL with rank 1's line, not retried. The killed rank is lost from outside: the trial is retried from its
checkpoint on a new worker (the worker's fault, not the trial's), its history holds every step once, and the log of the collectives each rank issued (``KDSWEEP_COLLECTIVE_LOG``) shows that after the failure no
rank started a collective but the one it was already blocked in, and none completed one. A plain 2-rank job whose
rank fails ends in one line naming the rank and what it was doing; its traceback is in that rank's log.
"""

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import QUIET, kdsweep, read_metrics, read_run
from test_sweep import manifest, search, study
from test_workers import train_steps, wait_for

pytestmark = pytest.mark.slow

STEPS, FAIL_AT = 12, 6


def _sweep_args(tmp_path: Path, name: str) -> list[str]:
    return [*search(tmp_path, name, {
        "n_trials": 1, "max_concurrent": 1, "workers": 1, "sampler": "random", "pruner": "none",
        "params": {"kd_ratio": "interval(0.0,1.0)"}, "enqueue": [{"kd_ratio": 0.4}],
    }, {"train": {"eval_every": STEPS, "max_steps": STEPS}, "dist": {"nproc_per_node": 2, "timeout_s": 600},
        "checkpoint": {"save_every": 4, "export_adapter": False, "export_merged": False}}), "train.threads=1", *QUIET]


def _logs(collectives: Path) -> dict[tuple[int, int], list[dict]]:
    """(rank, pid) -> that process's collectives, in order."""
    from kdsweep.distributed.comm import read_log

    out = {}
    for path in collectives.glob("rank*-*.jsonl"):
        rank, pid = path.stem.removeprefix("rank").split("-")
        out[(int(rank), int(pid))] = read_log(path)
    return out


@pytest.fixture(scope="module")
def failed_workers(tmp_path_factory, zoo_dirs):
    """Two one-trial sweeps on 2-rank warm workers, side by side: in one, rank 1 raises after step 6; in the other,
    the test kills rank 1 with kill -9 once step 6 is written."""
    root = tmp_path_factory.mktemp("rank_failures")
    runs = {}
    for name in ("raised", "killed"):
        (root / name).mkdir()
        env = {"KDSWEEP_COLLECTIVE_LOG": str(root / name / "collectives")}
        if name == "raised":
            env["KDSWEEP_TEST_RAISE_AT"] = f"1:{FAIL_AT}"
        runs[name] = SimpleNamespace(dir=root / name, sweep=root / name / "sweep", env=env,
                                     collectives=root / name / "collectives")
    with ThreadPoolExecutor(1) as pool:
        raised = runs["raised"]
        done = pool.submit(kdsweep, *_sweep_args(raised.dir, "raised"), f"hydra.sweep.dir={raised.sweep}",
                           cwd=raised.dir, env_extra=raised.env, check=False)
        killed = runs["killed"]
        proc = subprocess.Popen([sys.executable, "-m", "kdsweep", *_sweep_args(killed.dir, "killed"),
                                 f"hydra.sweep.dir={killed.sweep}"], cwd=killed.dir, env={**os.environ, **killed.env},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: len(train_steps(killed.sweep / "0")) >= FAIL_AT, f"step {FAIL_AT} of the killed sweep", proc)
        (victim,) = [pid for rank, pid in _logs(killed.collectives) if rank == 1]
        killed.failed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        killed.out, killed.err = proc.communicate(timeout=600)
        killed.code = proc.returncode
        result = done.result()
        raised.code, raised.out, raised.err = result.returncode, result.stdout, result.stderr
        # when rank 1 failed: the mark it logged before it refused every collective
        marks = [e for (rank, _), entries in _logs(raised.collectives).items() if rank == 1 for e in entries
                 if e["phase"] == "failed"]
        raised.failed_at, raised.mark = (marks[0]["t"], marks[0]["reason"]) if len(marks) == 1 else (None, marks)
    return runs


def test_a_rank_s_own_error_fails_its_trial_with_that_rank_s_line_and_is_not_retried(failed_workers):
    run = failed_workers["raised"]
    assert run.code == 0, run.err[-3000:]  # the sweep goes on (and here ends: its one trial is done)
    trial = manifest(run.sweep)["trials"]["0"]
    assert [t.state.name for t in study(run.sweep, "raised").trials] == ["FAIL"]
    assert trial["state"] == "FAIL" and trial["attempts"] == 1 and "restarting it" not in run.out + run.err
    assert trial["reason"].startswith("rank 1 (") and \
        f"failed while training step {FAIL_AT}: RuntimeError: injected" in trial["reason"], trial["reason"]
    assert run.failed_at is not None and not _new_worker_pids(run)  # no retry, so no new worker's ranks


@pytest.mark.parametrize("how", ["killed"])
def test_a_lost_rank_retries_its_trial_on_a_new_worker_from_its_checkpoint(failed_workers, how):
    run = failed_workers[how]
    assert run.code == 0, run.err[-3000:]
    trial = manifest(run.sweep)["trials"]["0"]
    assert [t.state.name for t in study(run.sweep, how).trials] == ["COMPLETE"]
    assert trial["attempts"] == 2 and trial["job"]["worker"] == "w1"  # not the trial's failure: retried elsewhere
    record = read_run(run.sweep / "0")
    assert record["resumed_from"] and record["start_step"] == 4  # its checkpoint before the failure
    assert train_steps(run.sweep / "0") == list(range(1, STEPS + 1))  # every step once
    assert [r["step"] for r in read_metrics(run.sweep / "0") if r["kind"] == "eval"] == [0, STEPS]
    # the dead worker's ranks were gone, and seen gone, within a minute (the retry starts only then)
    assert run.failed_at is not None and trial["last_start"] - run.failed_at < 60
    old = {pid for (rank, pid) in _logs(run.collectives)} - set(_new_worker_pids(run))
    assert len(old) == 2 and not any(Path(f"/proc/{pid}").exists() for pid in old)


def _new_worker_pids(run) -> list[int]:
    """The collective logs' processes that started after the failure (the new worker's ranks)."""
    return [pid for (rank, pid), entries in _logs(run.collectives).items() if entries and entries[0]["t"] > run.failed_at]


@pytest.mark.parametrize("how", ["raised", "killed"])
def test_no_rank_completes_or_starts_a_new_collective_after_the_failure(failed_workers, how):
    run = failed_workers[how]
    new = set(_new_worker_pids(run))
    old = {key: entries for key, entries in _logs(run.collectives).items() if key[1] not in new}
    assert sorted(rank for rank, _ in old) == [0, 1]
    for (rank, _), entries in old.items():
        # a collective both ranks had entered may still end after the failure; none begun after it may
        starts = [i for i, e in enumerate(entries) if e["phase"] == "start" and e["t"] > run.failed_at]
        ended = [i for i in starts if i + 1 < len(entries) and entries[i + 1]["phase"] == "end"]
        assert len(starts) <= 1 and not ended, (rank, entries[-4:])
        if how == "raised" and rank == 1:  # the failing rank itself: nothing after its error, only its failure mark
            assert not starts and entries[-1]["phase"] == "failed", entries[-3:]
    if how == "raised":  # the mark rank 1 logged is its own error, not a lost peer
        assert run.mark == f"rank 1 failed while training step {FAIL_AT}"


def test_a_plain_job_whose_rank_fails_ends_in_one_line_with_the_traceback_in_that_ranks_log(tmp_path, zoo_dirs):
    run_dir = tmp_path / "run"
    proc = kdsweep("dist=fsdp2_local", "train=smoke", "checkpoint.export_merged=false", *QUIET,
                   f"hydra.run.dir={run_dir}", cwd=tmp_path, check=False, env_extra={"KDSWEEP_TEST_RAISE_AT": "1:3"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kdsweep: error:")]
    assert proc.returncode == 1 and len(errors) == 1 and proc.stderr.strip().splitlines()[-1] == errors[0], proc.stderr
    assert errors[0].startswith("kdsweep: error: rank 1 (") and "failed while training step 3: RuntimeError: injected" \
        in errors[0] and str(run_dir / "logs" / "rank1.log") in errors[0], errors[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "Traceback" in (run_dir / "logs" / "rank1.log").read_text()
    assert read_run(run_dir)["status"] in ("interrupted", "running")  # rank 0 lost its peer: not its own failure
