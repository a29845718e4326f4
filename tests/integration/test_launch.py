"""A sweep never runs a trial twice, a job spans nodes, and launch mistakes are one line.

- The controller is killed (SIGKILL) at each point of a trial's launch, with local and SLURM trials; after
  ``kdsweep resume`` every trial ran exactly once.
- Two simulated nodes of two ranks (torchrun with two agents; the SLURM variables of a 2-node job) train as one
  rank does; a run directory a node does not share is one line.
- ``sbatch -n2`` without srun is one line at once (and what it suggests runs); spawned ranks log no
  nproc_per_node warning; a too-short dataset under 2 spawned ranks is one line and its hint runs; the
  empty-search-space hint works as typed; a trial that failed while no controller
  watched keeps its reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import QUIET, free_port, kdsweep, read_metrics, read_run, tiny_sweep

pytestmark = pytest.mark.slow

CRASH_AT = "KDSWEEP_TEST_CRASH_AT"
POINTS = ("before_launch", "after_launch", "after_write")
SLURM = ["hydra/launcher=submitit_slurm", "cluster=local_cpu"]
UNFINISHED = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}


def study_trials(sweep_dir: Path) -> int:
    import optuna

    storage = f"sqlite:///{sweep_dir / 'optuna.db'}"
    (summary,) = optuna.get_all_study_summaries(storage)
    return summary.n_trials


def assert_each_trial_ran_once(sweep_dir: Path, n: int) -> None:
    manifest = json.loads((sweep_dir / "sweep.json").read_text())
    assert sorted(int(k) for k in manifest["trials"]) == list(range(n))
    assert {t["state"] for t in manifest["trials"].values()} == {"COMPLETE"}, manifest["trials"]
    assert study_trials(sweep_dir) == n
    for number in range(n):
        run_dir = sweep_dir / str(number)
        record = read_run(run_dir)
        assert record["attempts"] == 1 and record["start_step"] == 0, (number, record["attempts"])
        assert (run_dir / "kdsweep.log").read_text().count("held-out CE before") == 1, number
        steps = [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"]
        assert steps == list(range(1, record["config"]["train"]["max_steps"] + 1)), number


def crashing_at(point: str, trial: int, command) -> subprocess.CompletedProcess:
    """``command()`` (the sweep's command, or ``kdsweep resume``) with its controller set to die as it launches
    ``trial``, at ``point``: killed (SIGKILL), it leaves the trial in the state that point means."""
    os.environ[CRASH_AT] = f"{point}:{trial}"  # read by the controller of each command (a new process)
    try:
        proc = command()
    finally:
        del os.environ[CRASH_AT]
    assert proc.returncode == -9, proc.stderr[-2000:]
    return proc


def crash_at_each_point_then_resume(tmp_path: Path, study: str, *args: str) -> Path:
    """A 4-trial sweep (all at once) whose controller dies as it launches trial 1 (before_launch); the resumed one
    dies as it launches trial 2 (after_launch), the next as it launches trial 3 (after_write), each while the
    trials before it run; a last ``kdsweep resume`` finishes the sweep. Returns the sweep directory."""
    sweep_dir = tmp_path / "sweep"

    def first() -> subprocess.CompletedProcess:
        trials = ["hydra.sweeper.n_trials=4", "hydra.sweeper.max_concurrent=4"]
        return tiny_sweep(tmp_path, study, *trials, *args, check=False)[1]

    def resume(check: bool = False) -> subprocess.CompletedProcess:
        return kdsweep("resume", str(sweep_dir), cwd=tmp_path, check=check)

    expected = {"before_launch": "STARTING", "after_launch": "STARTING", "after_write": "RUNNING"}
    for trial, point in enumerate(POINTS, start=1):  # trial 1: before_launch, 2: after_launch, 3: after_write
        proc = crashing_at(point, trial, first if trial == 1 else resume)
        manifest = json.loads((sweep_dir / "sweep.json").read_text())
        assert manifest["trials"][str(trial)]["state"] == expected[point], (point, manifest["trials"])
        if point == "after_write":  # this resume began by adopting the job the after_launch crash left unrecorded
            assert "trial 2: adopted its job" in proc.stdout + proc.stderr
    resume(check=True)
    return sweep_dir


def test_a_controller_killed_while_launching_a_local_trial_runs_it_once(tmp_path, zoo_dirs):
    """Killed at each point (before_launch, after_launch, after_write) of a trial's assignment to a warm worker (the
    default), resumed each time."""
    sweep_dir = crash_at_each_point_then_resume(tmp_path, "crash")
    assert_each_trial_ran_once(sweep_dir, 4)


@pytest.mark.usefixtures("slurm_cluster")
def test_a_controller_killed_while_submitting_a_slurm_trial_runs_it_once(tmp_path, zoo_dirs):
    """Killed at each point (before_launch, after_launch, after_write) of a trial job's submission (workers=0),
    resumed each time."""
    sweep_dir = crash_at_each_point_then_resume(tmp_path, "slurm_crash", *SLURM, "hydra.sweeper.workers=0")
    assert_each_trial_ran_once(sweep_dir, 4)
    jobs = {read_run(sweep_dir / str(n))["environment"]["slurm"]["job_id"] for n in range(4)}
    assert len(jobs) == 4  # one SLURM job per trial, never a second one for a trial a controller died launching


def test_a_trial_that_failed_while_no_controller_watched_keeps_its_reason(tmp_path, zoo_dirs):
    """Its job refused its data before writing a record (2 local ranks tokenize before they start), so all it
    left is its one line: that is the trial's reason, and it is not retried as if it had been killed."""
    bad = tmp_path / "bad.jsonl"  # the preflight reads 100 rows; row 150 fails the job itself, in one line
    bad.write_text("".join('{"text": "in the beginning"}\n' for _ in range(149)) + '{"content": "x"}\n')
    os.environ[CRASH_AT] = "after_write:0"
    try:
        sweep_dir, proc = tiny_sweep(tmp_path, "reason", "hydra.sweeper.n_trials=1", "hydra.sweeper.workers=0", "data=text",
                                     f"data.datasets.0.path={bad}", "data.seq_len=16", "dist.nproc_per_node=2",
                                     check=False)
    finally:
        del os.environ[CRASH_AT]
    assert proc.returncode == -9
    deadline = time.time() + 120  # the orphaned job fails on its own
    while "kdsweep: error:" not in (sweep_dir / "0" / "job.log").read_text():
        assert time.time() < deadline
        time.sleep(0.5)
    time.sleep(1)
    kdsweep("resume", str(sweep_dir), cwd=tmp_path)
    trial = json.loads((sweep_dir / "sweep.json").read_text())["trials"]["0"]
    assert trial["state"] == "FAIL" and trial["attempts"] == 1, trial  # its reason, not a retry
    assert not (sweep_dir / "0" / "run.json").exists()
    assert trial["reason"].startswith("kdsweep: error:") and "row 150: no column 'text'" in trial["reason"]


def test_a_trial_that_completed_while_no_controller_watched_is_judged_and_the_resume_prints_its_summary(tmp_path,
                                                                                                        zoo_dirs):
    """One job per trial (workers=0); the controller is killed just after launching trial 0, before writing its
    job down. The job completes alone; the resume finds its record, not its process: it takes the trial's result,
    exits 0 and prints the summary, naming the job as one that ended unwatched."""
    os.environ[CRASH_AT] = "after_launch:0"
    try:
        sweep_dir, proc = tiny_sweep(tmp_path, "unwatched", "hydra.sweeper.n_trials=1", "hydra.sweeper.workers=0",
                                     check=False)
    finally:
        del os.environ[CRASH_AT]
    assert proc.returncode == -9
    record = sweep_dir / "0" / "run.json"
    deadline = time.time() + 300  # the orphaned job completes on its own
    while not (record.exists() and read_run(sweep_dir / "0")["status"] == "completed"):
        assert time.time() < deadline
        time.sleep(0.5)
    time.sleep(1)  # its process exits after its record
    resumed = kdsweep("resume", str(sweep_dir), cwd=tmp_path)
    trial = json.loads((sweep_dir / "sweep.json").read_text())["trials"]["0"]
    assert trial["state"] == "COMPLETE" and trial["values"] == [read_run(sweep_dir / "0")["objective"]], trial
    assert "ended unwatched" in resumed.stdout + resumed.stderr and "Traceback" not in resumed.stderr
    status = kdsweep("status", str(sweep_dir), cwd=tmp_path).stdout
    assert "ended unwatched" in status


SMALL = ["train.max_steps=3", "train.eval_every=3", "data.batch_size=16", "data.micro_batch_size=4",
         "checkpoint.save_every=0", "checkpoint.export_merged=false", "checkpoint.export_adapter=false", *QUIET]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, zoo_dirs):
    root = tmp_path_factory.mktemp("one_rank")
    kdsweep(*SMALL, f"hydra.run.dir={root / 'run'}", cwd=root)
    return root / "run"


def assert_same_run(a: Path, b: Path, tol: float = 1e-5) -> None:
    ra = [r for r in read_metrics(a) if r["kind"] == "train"]
    rb = [r for r in read_metrics(b) if r["kind"] == "train"]
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(1, 4))
    for x, y in zip(ra, rb):
        for key in ("loss", "ce", "kd", "grad_norm"):
            assert x[key] == pytest.approx(y[key], abs=tol, rel=tol), (x["step"], key)
    assert read_run(a)["objective"] == pytest.approx(read_run(b)["objective"], abs=tol)


def test_two_torchrun_agents_of_two_ranks_each_match_one_rank(one_rank, tmp_path):
    run_dir = tmp_path / "run"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{free_port()}", "--rdzv-id", "two-nodes", "-m", "kdsweep", *SMALL, f"hydra.run.dir={run_dir}"]
    agents = [subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    outs = [a.communicate(timeout=600) for a in agents]
    assert all(a.returncode == 0 for a in agents), [o[1][-2000:] for o in outs]
    assert read_run(run_dir)["world_size"] == 4
    assert sorted(p.name for p in (run_dir / "logs").glob("rank*.log")) == ["rank1.log", "rank2.log", "rank3.log"]
    assert_same_run(one_rank, run_dir)


def slurm_task_env(rank: int, job: str) -> dict[str, str]:
    """What srun exports to task ``rank`` of a 2-node × 2-task step on nodes 127.0.0.1 and 127.0.0.2 (loopback
    addresses both, so the simulated nodes are this machine)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    return {**env, "SLURM_JOB_ID": job, "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank % 2), "SLURM_NODEID": str(rank // 2), "SLURM_NNODES": "2", "SLURM_NTASKS": "4",
            "SLURM_STEP_NUM_TASKS": "4", "SLURM_JOB_NODELIST": "127.0.0.[1-2]", "SLURM_STEP_NODELIST": "127.0.0.[1-2]",
            "PYTHONUNBUFFERED": "1"}


def run_slurm_tasks(tmp_path: Path, run_dir: Path, job: str, private_run_dir_on_node2: bool = False) -> list:
    procs = []
    for rank in range(4):
        cmd = [sys.executable, "-m", "kdsweep", *SMALL, f"hydra.run.dir={run_dir}"]
        if private_run_dir_on_node2 and rank >= 2:  # node 2 mounts its own empty directory over the run dir
            script = f'mkdir -p "{run_dir}" && mount -t tmpfs tmpfs "{run_dir}" && exec "$@"'
            cmd = ["unshare", "-m", "sh", "-c", script, "sh", *cmd]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=slurm_task_env(rank, job), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return [(p, *p.communicate(timeout=600)) for p in procs]


def test_the_slurm_tasks_of_two_nodes_match_one_rank(one_rank, tmp_path):
    run_dir = tmp_path / "run"
    results = run_slurm_tasks(tmp_path, run_dir, job=str(time.time_ns() % 10**9))
    assert all(p.returncode == 0 for p, _, _ in results), [err[-2000:] for _, _, err in results]
    record = read_run(run_dir)
    assert record["world_size"] == 4 and record["environment"]["slurm"]["nodelist"] == "127.0.0.[1-2]"
    assert_same_run(one_rank, run_dir)


def test_a_run_directory_a_node_does_not_share_is_one_line(tmp_path, zoo_dirs):
    results = run_slurm_tasks(tmp_path, tmp_path / "run", job=str(time.time_ns() % 10**9), private_run_dir_on_node2=True)
    for p, out, err in results:
        lines = err.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1, err[-2000:]
        assert f"{tmp_path / 'run'} (the run directory) is not shared by the job's nodes: rank 2" in lines[0]


@pytest.mark.usefixtures("slurm_cluster")
def test_sbatch_of_two_tasks_without_srun_is_one_line_and_srun_works(tmp_path, zoo_dirs):
    def sbatch(command: str) -> tuple[int, str]:
        """The job's exit code and output. Its end is polled every 0.5 s: ``sbatch --wait`` sleeps 2, 8, then 32 s
        between its own polls, which kept a 10-s job waited on for 40 s."""
        out = tmp_path / f"job{len(list(tmp_path.glob('job*.out')))}.out"
        job = subprocess.run(["sbatch", "-n2", "--parsable", "-o", str(out), "--wrap", command], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60, check=True).stdout.strip()
        deadline = time.time() + 600
        while True:
            show = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
            if show.split("JobState=")[1].split()[0] not in UNFINISHED:
                return int(show.split(" ExitCode=")[1].split(":")[0]), out.read_text()
            assert time.time() < deadline, show
            time.sleep(0.5)

    args = f"train=smoke train.max_steps=1 checkpoint.export_merged=false logger=quiet hydra.run.dir={tmp_path}/run"
    started = time.time()
    code, out = sbatch(f"{sys.executable} -m kdsweep {args}")
    assert code != 0 and time.time() - started < 120  # at once, not after dist.timeout_s
    errors = [line for line in out.splitlines() if line.startswith("kdsweep: error:")]
    assert len(errors) == 1 and "not started by srun" in errors[0] and "Traceback" not in out, out[-2000:]
    code, out = sbatch(f"srun {sys.executable} -m kdsweep {args}")  # what the line says to do
    assert code == 0, out[-2000:]
    assert read_run(tmp_path / "run")["world_size"] == 2


@pytest.fixture(scope="module")
def too_short_dataset(tmp_path_factory, zoo_dirs):
    """Two spawned ranks on a dataset too short for data.seq_len=128, then at the data.seq_len its one line names:
    the refused run, the run that followed the line, and its run directory (two tests read them)."""
    root = tmp_path_factory.mktemp("too_short")
    data = root / "short.jsonl"
    data.write_text('{"text": "a short line of text"}\n' * 3)
    args = ["dist.nproc_per_node=2", "train=smoke", "train.max_steps=1", "data=text", f"data.datasets.0.path={data}",
            "data.seq_len=128", "checkpoint.export_merged=false", *QUIET]
    refused = kdsweep(*args, f"hydra.run.dir={root / 'bad'}", cwd=root, check=False)
    assert "data.seq_len=<at most " in refused.stderr, refused.stderr[-2000:]
    at_most = int(refused.stderr.split("data.seq_len=<at most ")[1].split(">")[0])  # what the line says to pass
    fixed = kdsweep(*args, f"data.seq_len={at_most}", f"hydra.run.dir={root / 'fixed'}", cwd=root)
    return refused, fixed, root / "fixed"


def test_local_ranks_log_no_warning_about_the_setting_that_started_them(too_short_dataset):
    _, proc, run_dir = too_short_dataset  # a run of 2 ranks spawned for dist.nproc_per_node=2
    logs = proc.stdout + proc.stderr + (run_dir / "kdsweep.log").read_text() + (run_dir / "logs" / "rank1.log").read_text()
    assert "nproc_per_node" not in logs and read_run(run_dir)["world_size"] == 2


def test_a_too_short_dataset_under_two_spawned_ranks_is_one_line_and_its_hint_runs(too_short_dataset):
    proc, _, fixed = too_short_dataset
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "makes no rows" in lines[0], proc.stderr[-2000:]
    assert read_run(fixed)["world_size"] == 2  # the run at the data.seq_len the line names (it exited 0)


def test_the_empty_search_space_hint_works_as_typed(tmp_path, zoo_dirs):
    sweep = ["-m", "hydra/sweeper=kdsweep_optuna", "hydra.sweeper.n_trials=1", "train=smoke", "train.max_steps=1",
             "checkpoint.export_merged=false", *QUIET, f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    proc = kdsweep(*sweep, cwd=tmp_path, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "nothing to search" in lines[0], proc.stderr
    hint = lines[0].split("e.g. ")[1].split(" (")[0]  # kd_ratio='interval(0.0,1.0)', as a shell would pass it
    assert hint == "kd_ratio='interval(0.0,1.0)'"
    kdsweep(*sweep, hint.replace("'", ""), cwd=tmp_path)
    assert read_run(tmp_path / "sweep" / "0")["status"] == "completed"


def test_a_reused_pid_is_not_mistaken_for_the_trial(tmp_path):
    from kdsweep.sweep.local import LocalProcesses, proc_start

    backend = LocalProcesses(1)
    me = {"pid": os.getpid(), "started": proc_start(os.getpid())}
    assert backend.poll(me) is None  # alive, and the process that was started
    assert backend.poll({**me, "started": "1"}) == "gone"  # the same pid, another process: the trial's ended
    assert shutil.which("unshare") is not None  # the unshared-directory test needs it (util-linux)
