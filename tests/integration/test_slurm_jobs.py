"""kdsweep on the real local SLURM cluster: 2-rank FSDP jobs per sweep point, FAILED jobs, preemption + requeue."""

import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import QUIET, kdsweep, read_metrics, read_run
from test_cli_run import smoke

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]
SLURM = ["hydra/launcher=submitit_slurm", "cluster=local_cpu"]
# One intra-op thread for a job that shares this 2-core machine with other processes (its 6 SLURM tasks, a job
# running beside it): torch's default of one per core makes every step wait on preempted threads. Threads only
# lay a run out (kdsweep lets them change on resume); the numbers agree far inside the tolerances compared here.
ONE_THREAD = ["train.threads=1"]


def sacct_states(array_job: str) -> dict[str, str]:
    out = subprocess.run(["sacct", "-o", "JobID,State,NodeList", "--parsable2", "-j", array_job],
                         capture_output=True, text=True, check=True).stdout
    return {line.split("|")[0]: line.split("|")[1] for line in out.splitlines()[1:] if line}


def wait_for_states(array_job: str, done: set[str], timeout: float = 90) -> dict[str, str]:
    deadline = time.time() + timeout
    while True:
        states = sacct_states(array_job)
        if states and all(s in done for s in states.values()) or time.time() > deadline:
            return states
        time.sleep(1)


def array_job_of(sweep_dir) -> str:
    (job,) = {p.name.split("_")[0] for p in (sweep_dir / ".submitit").iterdir() if p.is_dir()}
    return job


def job_comments(array_job: str) -> set[str]:
    """The sbatch --comment of every task of an array job, as slurmctld holds it."""
    out = subprocess.run(["scontrol", "show", "job", array_job], capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"Comment=(\S+)", out))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> dict[str, str]:
    """A site's own presets (KDSWEEP_CONFIG_DIR): ``cluster/site_cpu.yaml`` under a new name and a
    ``cluster/local_cpu.yaml`` that shadows the shipped one, each the shipped local_cpu with a comment of its own
    (which the jobs' records show, so that which preset took effect is seen on the cluster)."""
    root = tmp_path_factory.mktemp("site")
    shipped = (Path(__file__).resolve().parents[2] / "conf" / "cluster" / "local_cpu.yaml").read_text()
    assert "  launcher:\n" in shipped
    (root / "cluster").mkdir()
    for name in ("site_cpu", "local_cpu"):
        preset = shipped.replace("  launcher:\n", f"  launcher:\n    comment: kdsweep-site-{name}\n")
        (root / "cluster" / f"{name}.yaml").write_text(preset)
    return {"KDSWEEP_CONFIG_DIR": str(root)}


@pytest.fixture(scope="module")
def failing_grid(tmp_path_factory, site):
    """The grid of test_a_failing_job_shows_failed, started in the background when a test first asks: (its sweep
    directory, the future of its finished process). Its job fails at once, but its launcher learns it only from
    sacct (polled ever less often) and then waits 15 s more for the result file that a job leaving with SystemExit
    never writes: the grid test asks first and the preemption test comes next, so these waits overlap their jobs.
    Its cluster=local_cpu is the site's own, which shadows the shipped preset, and its setup a line of its own."""
    root = tmp_path_factory.mktemp("failing")
    sweep = root / "sweep"
    with ThreadPoolExecutor(1) as pool:
        yield sweep, pool.submit(kdsweep, "-m", "kd_ratio=0.5", *SLURM, "train.device=cuda", *QUIET,
                                 "hydra.launcher.setup=[echo site-setup]", f"hydra.sweep.dir={sweep}", cwd=root,
                                 check=False, env_extra=site)


@pytest.mark.usefixtures("failing_grid")
def test_grid_runs_one_two_rank_fsdp_job_per_point(tmp_path, tmp_path_factory, zoo_dirs, site):
    sweep = tmp_path / "sweep"  # on the site's own preset of a new name (KDSWEEP_CONFIG_DIR), the shipped one's copy
    proc = kdsweep("-m", "kd_ratio=0.3,0.5", "hydra/launcher=submitit_slurm", "cluster=site_cpu", "train=smoke",
                   *ONE_THREAD, *QUIET, f"hydra.sweep.dir={sweep}", cwd=tmp_path, env_extra=site)
    table = re.findall(r"job (\d): objective ([\d.]+)\s+completed\s+ranks 2 slurm (\S+)", proc.stdout)
    assert [j for j, _, _ in table] == ["0", "1"], proc.stdout
    records = [read_run(sweep / str(i)) for i in range(2)]
    assert [r["config"]["loss"]["kd_ratio"] for r in records] == [0.3, 0.5]
    assert all(r["world_size"] == 2 and r["status"] == "completed" for r in records)
    assert [float(o) for _, o, _ in table] == pytest.approx([r["objective"] for r in records], abs=1e-4)
    # each job really was 2 SLURM tasks, each a rank with its own log
    assert all((sweep / str(i) / "logs" / "rank1.log").exists() for i in range(2))
    array_job = array_job_of(sweep)
    states = wait_for_states(array_job, {"COMPLETED"})
    assert sorted(states) == [f"{array_job}_{i}" for i in range(2)] and set(states.values()) == {"COMPLETED"}, states
    assert job_comments(array_job) == {"kdsweep-site-site_cpu"}  # the site's preset took effect on the cluster

    # the SLURM 2-rank result is the local 1-rank result of the same point (train=smoke at the default
    # kd_ratio=0.5: the smoke run test_cli_run checks, made once per session)
    local, _ = smoke(tmp_path_factory)
    assert records[1]["objective"] == pytest.approx(read_run(local)["objective"], abs=1e-5)


PREEMPT = ["kd_ratio=0.5", "train.max_steps=24", "train.eval_every=8", "checkpoint.save_every=1000",
           "checkpoint.export_merged=false", *QUIET]


def test_preempted_job_checkpoints_at_the_signal_requeues_and_resumes(tmp_path, zoo_dirs):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "kdsweep", "-m", *PREEMPT, *SLURM, f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = sweep / "0" / "metrics.jsonl"
    deadline = time.time() + 180
    while not (metrics.exists() and any(r.get("step", 0) >= 5 for r in map(json.loads, metrics.read_text().splitlines()))):
        assert time.time() < deadline and proc.poll() is None, "the job did not reach step 5"
        time.sleep(0.2)
    array_job = array_job_of(sweep)
    # what SLURM sends before preemption or the time limit (submitit asks for USR2)
    subprocess.run(["scancel", "--signal=USR2", array_job], check=True)
    reference = tmp_path / "reference"
    with ThreadPoolExecutor(1) as pool:  # the uninterrupted reference runs while the job waits to be requeued
        reference_done = pool.submit(kdsweep, *PREEMPT, *ONE_THREAD, f"hydra.run.dir={reference}", cwd=tmp_path)
        out, _ = proc.communicate(timeout=300)
        reference_done.result()
    assert proc.returncode == 0, out[-3000:]

    record = read_run(sweep / "0")
    assert record["status"] == "completed" and record["attempts"] == 2
    assert [a["restart_count"] for a in record["slurm_attempts"]] == ["0", "1"]
    signal_step = record["start_step"]
    assert 5 <= signal_step < 24  # resumed from the checkpoint written at the signal, not from the start
    logs = "".join(p.read_text() for p in (sweep / ".submitit").glob("*/*_0_log.err"))
    assert f"preempted at step {signal_step} (checkpoint written)" in logs and "Requeued job" in logs
    assert [r["step"] for r in read_metrics(sweep / "0") if r["kind"] == "train"] == list(range(1, 25))

    assert record["objective"] == pytest.approx(read_run(reference)["objective"], abs=1e-5)


def test_a_failing_job_shows_failed(failing_grid):
    sweep, proc = failing_grid
    proc = proc.result()
    assert proc.returncode != 0
    assert "train.device=cuda but no CUDA device" in proc.stdout + proc.stderr  # the job's one line reaches the user
    states = wait_for_states(array_job_of(sweep), {"FAILED", "COMPLETED"})
    assert set(states.values()) == {"FAILED"}, states
    assert job_comments(array_job_of(sweep)) == {"kdsweep-site-local_cpu"}  # the site's shadow, not the shipped
    # its own setup line replaced the preset's, and the line that ends every rank when one dies was kept
    (script,) = (sweep / ".submitit").glob("*/*_submission.sh")
    setup = script.read_text().split("# setup\n")[1].split("\n\n")[0].splitlines()
    assert setup == ["echo site-setup", "export SLURM_KILL_BAD_EXIT=1"], setup
