"""The local SLURM cluster (launchers/slurm) does what kdsweep needs: multi-task jobs, job states through the
sacct shim, and submitit's submit / result / failure / checkpoint-and-requeue cycle. Real daemons, no mocks.

Needs root on Debian: the slurm_cluster fixture (conftest) runs launchers/slurm/up.sh, which is idempotent.
"""
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cloudpickle
import pytest
import submitit
from submitit.core.utils import FailedJobError, UncompletedJobError
from submitit.slurm.slurm import SlurmInfoWatcher

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]

UNFINISHED = {"READY", "PENDING", "RUNNING", "UNKNOWN", "REQUEUED", "COMPLETING", "PREEMPTED"}  # as submitit

# The jobs below run functions of this module, which the job's Python cannot import: pickle them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def sbatch_wait(*args: str) -> tuple[int, str]:
    """Submit, wait for the end; return (the job's exit code, its id)."""
    proc = subprocess.run(["sbatch", "--wait", "--parsable", *args], capture_output=True, text=True, timeout=90)
    return proc.returncode, proc.stdout.strip().split(";")[0]


def sacct(*ids: str) -> str:
    """Exactly submitit's call (SlurmInfoWatcher._make_command)."""
    cmd = ["sacct", "-o", "JobID,State,NodeList", "--parsable2"] + [a for i in ids for a in ("-j", i)]
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30).stdout


def executor(folder: Path, **params) -> submitit.AutoExecutor:
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm")  # slurm or fail, never the local fallback
    ex.update_parameters(slurm_partition="debug", timeout_min=5, **params)
    return ex


def wait_done(job: submitit.Job, timeout: float = 90) -> None:
    """job.wait(), but a job that never finishes fails the test instead of hanging it."""
    deadline = time.monotonic() + timeout
    while not job.done():
        if time.monotonic() > deadline:
            job.cancel(check=False)
            pytest.fail(f"job {job.job_id} not done after {timeout} s (state {job.state}):\n{job.stderr()}")
        time.sleep(0.5)


def final_state(job: submitit.Job, timeout: float = 30) -> str:
    """The job's SLURM state once SLURM has finished it, asked through sacct like submitit does."""
    deadline = time.monotonic() + timeout
    while (state := job.watcher.get_state(job.job_id, mode="force")) in UNFINISHED:
        assert time.monotonic() < deadline, f"job {job.job_id} still {state} after {timeout} s"
        time.sleep(0.5)
    return state


# --- Functions and callables run in the jobs ---

def rank_and_answer():
    return int(os.environ["SLURM_PROCID"]), 42


def boom():
    raise ValueError("boom from the job")


def die():
    os._exit(3)  # no result file: only SLURM (via sacct) can tell submitit that this job is over


class Counter:
    """Counts steps, writing progress. Its first run counts until preempted (2 min at most); submitit then calls
    checkpoint(), requeues the job, and the run after the restart resumes from the checkpointed step."""

    def __init__(self, folder: str):
        self.folder, self.step = Path(folder), 0

    def __call__(self):
        from kdsweep.distributed.signals import harden_submitit_requeue

        # the requeue kdsweep's jobs use: submitit's own `scontrol requeue` can be killed by the SIGTERM of the
        # requeue it asked for, and submitit then records an error for a job SLURM is running again
        harden_submitit_requeue()
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        (self.folder / f"run{restarts}.txt").write_text(f"SLURM_RESTART_COUNT={restarts}\nstart={self.step}\n")
        resumed_at = self.step
        limit = self.step + 5 if restarts else 2400
        while self.step < limit:
            self.step += 1
            (self.folder / "progress.txt").write_text(f"{restarts} {self.step}\n")
            time.sleep(0.05)
        return {"restarts": restarts, "resumed_at": resumed_at, "step": self.step}

    def checkpoint(self):
        return submitit.helpers.DelayedSubmission(self)


# --- Tests ---

@pytest.fixture(scope="module")
def early_jobs(tmp_path_factory):
    """The jobs of test_submitit_two_tasks_return_results and test_submitit_failing_jobs_end_with_failed, submitted
    when the module's first test starts, so that SLURM schedules and runs them while the sbatch tests run."""
    root = tmp_path_factory.mktemp("submitit")
    failing = executor(root / "failing")
    return {"two_tasks": executor(root / "two_tasks", tasks_per_node=2).submit(rank_and_answer),
            "raising": failing.submit(boom), "dying": failing.submit(die)}


@pytest.mark.usefixtures("early_jobs")
def test_two_task_sbatch_runs_srun_ranks(tmp_path):
    out = tmp_path / "out.txt"
    rc, _ = sbatch_wait("-n", "2", "-o", str(out), "--wrap", 'srun bash -c "echo SLURM_PROCID=\\$SLURM_PROCID"')
    assert rc == 0, out.read_text() if out.exists() else "no output"
    assert sorted(out.read_text().split()) == ["SLURM_PROCID=0", "SLURM_PROCID=1"]


def test_sacct_shim_reports_states_as_submitit_reads_them(tmp_path):
    log = str(tmp_path / "%j.out")
    with ThreadPoolExecutor(3) as pool:  # three jobs at once, each waited for
        (rc_ok, ok), (rc_bad, bad), (rc_arr, arr) = pool.map(lambda args: sbatch_wait("-o", log, *args), [
            ("--wrap", "true"), ("--wrap", "exit 3"), ("--array=0-2", "--wrap", "exit $SLURM_ARRAY_TASK_ID")])
    assert (rc_ok, rc_bad, rc_arr) == (0, 3, 2)

    out = sacct(ok, bad, "99999999")  # an unknown id is left out, as sacct does
    assert out.splitlines()[0] == "JobID|State|NodeList"
    assert sorted(out.splitlines()[1:]) == sorted([f"{ok}|COMPLETED|localhost", f"{bad}|FAILED|localhost"])

    # Through submitit's own watcher: one sacct call for all the jobs, array tasks split out.
    watcher = SlurmInfoWatcher(delay_s=600)
    held = subprocess.run(["sbatch", "--parsable", "--hold", "--array=0-3%2", "-o", log, "--wrap", "true"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ids = (ok, bad, f"{arr}_0", f"{arr}_1", f"{arr}_2", f"{held}_0", f"{held}_3")
    for jid in ids:
        watcher.register_job(jid)
    watcher.update()
    states = {jid: watcher.get_state(jid, mode="cache") for jid in ids}
    assert states == {ok: "COMPLETED", bad: "FAILED", f"{arr}_0": "COMPLETED", f"{arr}_1": "FAILED",
                      f"{arr}_2": "FAILED", f"{held}_0": "PENDING", f"{held}_3": "PENDING"}
    subprocess.run(["scancel", held], check=True)
    deadline = time.monotonic() + 30
    while (state := watcher.get_state(f"{held}_2", mode="force")) == "PENDING" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert state == "CANCELLED"


def test_submitit_two_tasks_return_results(early_jobs):
    job = early_jobs["two_tasks"]
    wait_done(job)
    # submitit 1.5.4's job.result() refuses a multi-task job (AssertionError "use results()"): task 0's value is
    # job.results()[0] (what hydra-submitit-launcher returns) or job.task(0).result().
    assert job.results() == [(0, 42), (1, 42)]
    assert job.task(0).result() == (0, 42)
    assert final_state(job) == "COMPLETED"


def test_submitit_failing_jobs_end_with_failed(early_jobs):
    raising, dying = early_jobs["raising"], early_jobs["dying"]
    start = time.monotonic()
    wait_done(raising)
    wait_done(dying)  # done only because sacct says FAILED: there is no result file
    with pytest.raises(FailedJobError, match="boom from the job"):
        raising.result()
    with pytest.raises(UncompletedJobError, match="has not produced any output"):
        dying.result()  # waits submitit's 15 s for a late result file, then raises
    assert time.monotonic() - start < 80
    assert final_state(raising) == "FAILED"
    assert final_state(dying) == "FAILED"


def test_submitit_checkpoint_requeue_resumes(tmp_path):
    job = executor(tmp_path / "submitit").submit(Counter(str(tmp_path)))
    deadline = time.monotonic() + 60
    while not (tmp_path / "progress.txt").exists():
        assert time.monotonic() < deadline, f"job {job.job_id} never started (state {job.state})"
        time.sleep(0.2)
    job._interrupt()  # as a preemption: SIGTERM (ignored by submitit), then USR2 -> checkpoint() + requeue

    wait_done(job, timeout=90)  # the requeued run starts ~6-10 s later (cred_expire=5)
    result = job.result()
    assert result["restarts"] == 1 and result["resumed_at"] > 0 and result["step"] == result["resumed_at"] + 5
    assert (tmp_path / "run1.txt").read_text().startswith("SLURM_RESTART_COUNT=1\n")
    assert final_state(job) == "COMPLETED"
    show = subprocess.run(["scontrol", "show", "job", "-o", job.job_id], capture_output=True, text=True).stdout
    assert " Restarts=1 " in show
