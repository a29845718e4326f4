"""Multi-rank jobs on CPU (gloo): 2 ranks match 1 rank; a kill -9 of one rank resumes; torchrun matches."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from conftest import QUIET, kdsweep, read_metrics, read_run
from test_resume import _wait_for_step

pytestmark = pytest.mark.slow

SMALL = ["train.max_steps=8", "train.eval_every=4", "checkpoint.save_every=2", "checkpoint.export_merged=false", *QUIET]


def train_rows(run_dir):
    return [r for r in read_metrics(run_dir) if r["kind"] == "train"]


def assert_same_run(a, b, tol=1e-5):
    ra, rb = train_rows(a), train_rows(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb):
        for key in ("loss", "ce", "kd", "grad_norm"):
            assert x[key] == pytest.approx(y[key], abs=tol, rel=tol), (x["step"], key)
        assert x["tokens"] == y["tokens"]
    assert read_run(a)["objective"] == pytest.approx(read_run(b)["objective"], abs=tol)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, zoo_dirs):
    root = tmp_path_factory.mktemp("one_rank")
    kdsweep(*SMALL, f"hydra.run.dir={root / 'run'}", cwd=root)
    return root / "run"


def test_two_ranks_match_one_rank(one_rank, tmp_path):
    run_dir = tmp_path / "two"
    proc = kdsweep(*SMALL, "dist=fsdp2_local", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert "2 ranks" in proc.stdout
    assert_same_run(one_rank, run_dir)
    record = read_run(run_dir)
    assert record["config"]["dist"]["nproc_per_node"] == 2
    assert (run_dir / "logs" / "rank1.log").read_text().count("held-out CE after") == 1
    assert (run_dir / "kdsweep.log").exists() and not (run_dir / "logs" / "rank0.log").exists()
    # sharded checkpoints: one DCP shard file per rank, and per-rank RNG/counters
    ckpt = run_dir / "checkpoints" / "step_00000008"
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert sorted(p.name for p in ckpt.glob("state_rank*.pt")) == ["state_rank0.pt", "state_rank1.pt"]
    assert (run_dir / "final" / "adapter" / "adapter_model.safetensors").exists()


def test_torchrun_matches_the_builtin_launcher(one_rank, tmp_path):
    run_dir = tmp_path / "torchrun"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--nproc_per_node", "2", "-m", "kdsweep", *SMALL, f"hydra.run.dir={run_dir}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("held-out CE: before") == 1  # one voice per job
    assert "2 ranks" in proc.stdout
    assert_same_run(one_rank, run_dir)


def test_torchrun_ranks_agree_on_the_output_dir(tmp_path, zoo_dirs):
    """Without hydra.run.dir each rank resolves ${now:...} itself; rank 0's directory must win."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--nproc_per_node", "2", "-m", "kdsweep", "train.max_steps=1",
                           "checkpoint.export_merged=false", "checkpoint.export_adapter=false", *QUIET],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [p for p in (tmp_path / "outputs" / "runs").glob("*/*") if p.is_dir()]
    assert len(runs) == 1 and read_run(runs[0])["status"] == "completed"


def _worker_pids(parent_pid):
    """The rank processes the launcher spawned (not multiprocessing's resource tracker)."""
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(parent_pid)], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "spawn_main" in line]


def test_kill_9_of_one_rank_then_rerun_resumes(one_rank, tmp_path):
    rng = random.Random(time.time_ns())
    kill_at, victim = rng.randint(3, 7), rng.randint(0, 1)
    print(f"killing rank {victim} at step {kill_at}")
    run_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "kdsweep", *SMALL, "dist=fsdp2_local", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    reached = _wait_for_step(run_dir, kill_at, proc, time.time() + 300)
    workers = sorted(_worker_pids(proc.pid))
    assert len(workers) == 2, workers
    os.kill(workers[victim], signal.SIGKILL)
    assert proc.wait(timeout=120) != 0, "a job whose rank died must fail"
    assert read_run(run_dir)["status"] in ("running", "failed")

    kdsweep(*SMALL, "dist=fsdp2_local", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    record = read_run(run_dir)
    assert record["status"] == "completed" and record["attempts"] == 2
    assert 2 * ((reached - 1) // 2) <= record["start_step"] < 8
    assert [r["step"] for r in train_rows(run_dir)] == list(range(1, 9))
    assert_same_run(one_rank, run_dir)


def test_sharding_options_keep_the_result(one_rank, tmp_path):
    """Activation checkpointing, CPU offload and no resharding change memory and speed, not the numbers."""
    run_dir = tmp_path / "options"
    kdsweep(*SMALL, "dist=fsdp2_local", "dist.activation_checkpointing=true", "dist.cpu_offload=true",
            "dist.reshard_after_forward=false", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert_same_run(one_rank, run_dir)


@pytest.fixture(scope="module")
def dense_one_rank(tmp_path_factory, zoo_dirs):
    root = tmp_path_factory.mktemp("dense")
    kdsweep(*SMALL, "loss.impl=dense", f"hydra.run.dir={root / 'run'}", cwd=root)
    return root / "run"


@pytest.mark.parametrize("options", [[], ["dist=fsdp2_local"],
                                     ["dist=fsdp2_local", "dist.reshard_after_forward=false", "dist.activation_checkpointing=true"]])
def test_fused_loss_matches_dense(dense_one_rank, tmp_path, options):
    """loss.impl=fused (hidden states projected chunk by chunk by the LoRA output layers, FSDP-sharded on 2 ranks)
    trains exactly as the dense logits path on one rank."""
    run_dir = tmp_path / "fused"
    kdsweep(*SMALL, "loss.impl=fused", "loss.num_chunks=5", *options, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert_same_run(dense_one_rank, run_dir)


TOO_MANY = len(os.sched_getaffinity(0)) + 1
def test_bf16_mixed_precision_and_bf16_weights_run(tmp_path, zoo_dirs):
    """Numerics differ from fp32 by design; these runs must train and give a finite objective near it."""
    fp32 = tmp_path / "fp32"
    kdsweep("train=smoke", "train.max_steps=2", *QUIET, f"hydra.run.dir={fp32}", cwd=tmp_path)
    for name, args in (("mixed", ["dist=fsdp2_local", "dist.mixed_precision=true"]), ("bf16", ["train.dtype=bf16"])):
        run_dir = tmp_path / name
        kdsweep("train=smoke", "train.max_steps=2", "checkpoint.export_merged=false", *args, *QUIET,
                f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert read_run(run_dir)["objective"] == pytest.approx(read_run(fp32)["objective"], abs=0.05), name


BAD = {
    "too_many_ranks": ([f"dist.nproc_per_node={TOO_MANY}"], f"dist.nproc_per_node={TOO_MANY} but this machine has"),
    "indivisible_batch": (["dist.nproc_per_node=2", "data.batch_size=8", "data.micro_batch_size=8"],
                          "data.batch_size=8 does not split over 2 ranks"),
    "unbindable_master": (["dist.nproc_per_node=2", "dist.master_addr=10.255.255.1"], "dist.master_addr=10.255.255.1"),
    "fp16": (["dist.nproc_per_node=2", "train.dtype=fp16"], "train.dtype"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_launch_input_is_one_line_before_any_rank_starts(case, tmp_path):
    args, expected = BAD[case]
    run_dir = tmp_path / "run"
    proc = kdsweep(*args, f"hydra.run.dir={run_dir}", cwd=tmp_path, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr
    assert not run_dir.exists()


def test_unresolvable_master_under_torchrun_is_one_line(tmp_path):
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "no-such-host.invalid",
           "MASTER_PORT": "29555"}
    proc = subprocess.run([sys.executable, "-m", "kdsweep", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "no-such-host.invalid" in lines[0], proc.stderr


def test_multirun_of_one_then_two_ranks_in_one_process(tmp_path, zoo_dirs):
    """The second job's ranks start after this process trained the first job itself (no fork deadlock)."""
    sweep = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "kdsweep", "-m", "dist.nproc_per_node=1,2", "train=smoke",
                           "train.max_steps=2", *QUIET, f"hydra.sweep.dir={sweep}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = read_run(sweep / "0"), read_run(sweep / "1")
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert two["objective"] == pytest.approx(one["objective"], abs=1e-5)
