"""Warm trial workers on the real local SLURM cluster: 6 trials on 2 worker jobs of 2 ranks; mid-trial, one worker is
requeued (scontrol requeue: SIGTERM) and the other warned of its time limit (USR2, as SLURM does signal_delay_s
before it): both checkpoint their trial, which resumes from there. Then a third worker's rank 0 is killed (kill -9)
mid-trial: its job ends at once (its other rank does not wait in a collective) and the trial resumes from its last
checkpoint on another worker."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import kdsweep, read_metrics, read_run
from test_slurm_jobs import ONE_THREAD
from test_sweep import manifest, search, study

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]


def jobs_named(fragment: str) -> dict[str, str]:
    out = subprocess.run(["sacct", "-X", "--parsable2", "--noheader", "-o", "JobID,JobName,State", "-S", "now-1hours"],
                         capture_output=True, text=True, check=True).stdout
    return {parts[0]: parts[2] for parts in (line.split("|") for line in out.splitlines()) if fragment in parts[1]}


def past_step(run_dir, step: int) -> bool:
    return (run_dir / "metrics.jsonl").exists() and any(r["step"] >= step for r in read_metrics(run_dir)
                                                         if r["kind"] == "train")


def test_six_trials_on_two_worker_jobs_and_a_requeued_or_warned_workers_trial_resumes(tmp_path, zoo_dirs):
    sweep_dir = tmp_path / "sweep"
    args = search(tmp_path, "slurmwarm", {
        "n_trials": 6, "max_concurrent": 2, "workers": 2, "sampler": "random", "pruner": "none", "poll_s": 0.5,
        "params": {"kd_ratio": "choice(0.2,0.4,0.5,0.6,0.8)", "train.max_steps": "choice(4,12)"},
        "enqueue": [*({"kd_ratio": 0.5, "train.max_steps": 12} for _ in range(3)),
                    *({"kd_ratio": k, "train.max_steps": 4} for k in (0.2, 0.4, 0.6))],
    }, {"train": {"eval_every": 4}, "checkpoint": {"save_every": 4, "export_adapter": False, "export_merged": False}})
    cmd = [sys.executable, "-m", "kdsweep", *args, *ONE_THREAD, "hydra/launcher=submitit_slurm", "cluster=local_cpu",
           f"hydra.sweep.dir={sweep_dir}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reference = tmp_path / "reference"
    with ThreadPoolExecutor(1) as pool:  # the uninterrupted reference of trial 0 runs beside the sweep
        reference_done = pool.submit(kdsweep, "hparams_search=slurmwarm", f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
                                     "kd_ratio=0.5", "train.max_steps=12", *ONE_THREAD, f"hydra.run.dir={reference}",
                                     cwd=tmp_path)
        deadline = time.time() + 300
        jobs, killed = {}, {}

        def kill_rank_0(job: str) -> None:  # trial 2's worker: its rank 0's process, on this machine
            killed.update(name=manifest(sweep_dir)["trials"]["2"]["job"]["worker"])
            state = json.loads((sweep_dir / "workers" / killed["name"] / "worker.json").read_text())
            assert state["state"] == "busy" and state["trial"] == 2 and state["slurm"]["job_id"] == job, state
            os.kill(state["pid"], signal.SIGKILL)

        for trial, hit in (("0", ["scontrol", "requeue"]), ("1", ["scancel", "--signal=USR2"]), ("2", kill_rank_0)):
            while not past_step(sweep_dir / trial, 6):
                assert time.time() < deadline and proc.poll() is None, f"trial {trial} did not reach step 6"
                time.sleep(0.3)
            jobs[trial] = read_run(sweep_dir / trial)["environment"]["slurm"]["job_id"]
            hit(jobs[trial]) if callable(hit) else subprocess.run([*hit, jobs[trial]], check=True)
        out, _ = proc.communicate(timeout=600)
        reference_done.result()
    assert proc.returncode == 0, out[-3000:]

    trials = study(sweep_dir, "slurmwarm").trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * 6
    # every job of this sweep (its names end with the sweep's tag): worker jobs only, no trial's own job; the one
    # whose rank was killed FAILED (a replacement may have been started for it), the others left when it was over
    workers = jobs_named("-" + hashlib.sha1(str(sweep_dir.resolve()).encode()).hexdigest()[:8])
    job_of = {p.parent.name: json.loads(p.read_text())["slurm_job_id"] for p in (sweep_dir / "workers").glob("*/launch.json")}
    launched = set(job_of.values())
    assert set(workers) == launched and len(launched) in (2, 3), workers
    assert workers.pop(jobs["2"]) == "FAILED" and set(workers.values()) == {"COMPLETED"}, workers
    entries = manifest(sweep_dir)["trials"]
    for n in range(6):  # each trial's directory as a trial job writes it, from a worker job of this sweep
        record = read_run(sweep_dir / str(n))
        assert record["status"] == "completed" and record["world_size"] == 2
        assert record["environment"]["slurm"]["job_id"] in launched
        logs = subprocess.run([sys.executable, "-m", "kdsweep", "logs", str(sweep_dir), str(n)], capture_output=True,
                              text=True)
        assert logs.returncode == 0 and logs.stdout.count("held-out CE after") == 1, logs.stdout[-2000:]

    # the requeued worker's trial (SIGTERM) and the warned one's (USR2): their ranks checkpointed at the next step,
    # the controller retried each (an attempt) and it resumed from its checkpoint in a worker job again (the
    # requeued one, or the one submitit requeued at USR2): every step once, the objective of an uninterrupted run
    assert jobs["0"] != jobs["1"]
    for trial, word in (("0", "SIGTERM"), ("1", "SIGUSR2")):
        record = read_run(sweep_dir / trial)
        assert entries[trial]["attempts"] == 2 and 6 <= record["start_step"] < 12, (trial, record["start_step"])
        assert f"received {word}" in (sweep_dir / trial / "kdsweep.log").read_text()
        assert [r["step"] for r in read_metrics(sweep_dir / trial) if r["kind"] == "train"] == list(range(1, 13))
        assert record["objective"] == pytest.approx(read_run(reference)["objective"], abs=1e-5)
    # the killed worker's trial: another attempt, from its last checkpoint (every 4 steps), on another worker
    record = read_run(sweep_dir / "2")
    assert entries["2"]["attempts"] == 2 and entries["2"]["job"]["worker"] != killed["name"]
    assert 4 <= record["start_step"] < 12 and record["start_step"] % 4 == 0, record["start_step"]
    assert [r["step"] for r in read_metrics(sweep_dir / "2") if r["kind"] == "train"] == list(range(1, 13))
    assert record["objective"] == pytest.approx(read_run(reference)["objective"], abs=1e-5)
    # each worker beside its own job (trial 0's retry may have gone to either requeued worker), the killed one gone
    worker = entries["0"]["job"]["worker"]
    status = kdsweep("status", str(sweep_dir), cwd=tmp_path).stdout
    assert f"worker {worker} (slurm {job_of[worker]}, 2 rank(s))" in status
    assert f"worker {killed['name']} (slurm {jobs['2']}, 2 rank(s))" in status
    (gone,) = [line for line in status.splitlines() if line.startswith(f"worker {killed['name']} ")]
    assert "gone while it ran trial 2" in gone, status
