"""Multi-rank jobs on CPU (gloo): 2 ranks match 1 rank; a kill -9 of one rank resumes; torchrun matches.

A job costs mostly its processes' start-up, so a job that several tests read runs once (a module fixture), and jobs
that differ only in overrides run as one Hydra multirun: one process runs them one after another, a 1-rank job in
itself and a 2-rank job in two spawned ranks. Every test keeps its own assertions on its own job.
"""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

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


def _is_group(key):
    from kdsweep.app import conf_dir

    return "." not in key and (Path(conf_dir()) / key).is_dir()


def _case_config(overrides):
    """A ``# @package _global_`` option that sets what OVERRIDES set (``group=option`` as ``override /group``; a
    top-level knob or list, ``lr=...`` or ``teachers=[...]``, as a value)."""
    defaults, body = [], {}
    for o in overrides:
        key, value = o.split("=", 1)
        if _is_group(key):
            defaults.append({f"override /{key}": value})
            continue
        *parents, leaf = key.split(".")
        node = body
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    return "# @package _global_\n" + yaml.safe_dump({"defaults": defaults, **body} if defaults else body)


def _assert_applied(run_dir, overrides):
    """The job's resolved config holds what its case's overrides say (a case that silently did not apply would
    still match its reference)."""
    from kdsweep.app import conf_dir

    values = {}
    for o in overrides:
        key, value = o.split("=", 1)
        if _is_group(key):  # a group option: the values its file sets, unless a dotted override of the case changes one
            option = yaml.safe_load((Path(conf_dir()) / key / f"{value}.yaml").read_text())
            if "dist" in option and key == "dist":  # a preset of the global package (fsdp2_gpu_bf16)
                option = option["dist"]
            values.update({f"{key}.{k}": v for k, v in option.items() if k != "defaults"})
    values.update({k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in overrides) if not _is_group(k)})
    config = read_run(run_dir)["config"]
    for key, value in values.items():
        if isinstance(value, str) and value.startswith("${"):  # an option's interpolation: resolved in the record
            continue
        node = config
        for part in key.split("."):
            node = node[part]
        assert node == value, (run_dir, key, node, value)


def multirun(root, cases, *common):
    """CASES (name -> that job's overrides, COMMON ones for all) as one Hydra multirun in ROOT/sweep.

    A grid of comma lists sweeps only a cartesian product, so each case is an option of a ``case`` config group
    in ROOT/conf (``-m +case=a,b,...``, as ``+experiment=...`` selects a preset). Returns the finished process and
    each case's run directory; every job that ran is checked to hold its case's overrides."""
    conf = root / "conf" / "case"
    conf.mkdir(parents=True)
    for name, overrides in cases.items():
        (conf / f"{name}.yaml").write_text(_case_config(overrides))
    sweep = root / "sweep"
    proc = kdsweep("-m", f"+case={','.join(cases)}", f"hydra.searchpath=[file://{root / 'conf'}]", *common,
                   f"hydra.sweep.dir={sweep}", cwd=root, check=False)
    dirs = {name: sweep / str(i) for i, name in enumerate(cases)}
    for name, overrides in cases.items():
        if (dirs[name] / "run.json").exists():
            _assert_applied(dirs[name], overrides)
    return proc, dirs


def summary_line(proc, run_dir):
    """The 'held-out CE: before ... -> after ...' line the job printed (the line before its 'outputs: RUN_DIR')."""
    lines = proc.stdout.splitlines()
    at = [i for i, line in enumerate(lines) if line.startswith(f"outputs: {run_dir} (")]
    assert len(at) == 1 and at[0] > 0 and lines[at[0] - 1].startswith("held-out CE: before"), proc.stdout
    return lines[at[0] - 1]


def completed(proc):
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


# SMALL without step checkpoints or an adapter export: what the fused jobs are compared on is their metrics rows
UNSAVED = [*(a for a in SMALL if not a.startswith("checkpoint.save_every")), "checkpoint.save_every=0",
           "checkpoint.export_adapter=false"]
FUSED = ["loss.impl=fused", "loss.chunk_mb=1.5"]  # 8 × 128 tokens × 2,048 in 6 chunks (the dense job: one)
FUSED_OPTIONS = [[], ["dist=fsdp2_local"],
                 ["dist=fsdp2_local", "dist.reshard_after_forward=false", "dist.activation_checkpointing=true"]]
# two teachers of the student's tokenizer (the frozen student's start beside the teacher), weighted 1 and 3
TWO_TEACHERS = "teachers=[{zoo: tiny-teacher, weight: 1}, {zoo: tiny-student, weight: 3}]"


@pytest.fixture(scope="module")
def small(tmp_path_factory, zoo_dirs):
    """The 1-rank SMALL job every 2-rank result must match and two 2-rank jobs of it: one multirun."""
    root = tmp_path_factory.mktemp("small")
    proc, dirs = multirun(root, {
        "one_rank": [],
        "two": ["dist=fsdp2_local"],
        "options": ["dist=fsdp2_local", "dist.activation_checkpointing=true", "dist.cpu_offload=true",
                    "dist.reshard_after_forward=false"],
    }, *SMALL)
    return completed(proc), dirs


@pytest.fixture(scope="module")
def fused(tmp_path_factory, zoo_dirs):
    """The SMALL job with dense logits and with the fused loss for each of FUSED_OPTIONS: one multirun."""
    root = tmp_path_factory.mktemp("fused")
    proc, dirs = multirun(root, {
        "dense": ["loss.impl=dense"],
        **{f"fused{i}": [*FUSED, *o] for i, o in enumerate(FUSED_OPTIONS)},
        "teachers_dense": ["loss.impl=dense", TWO_TEACHERS],
        "teachers_fused": [*FUSED, "dist=fsdp2_local", TWO_TEACHERS],
    }, *UNSAVED)
    return completed(proc), dirs


@pytest.fixture(scope="module")
def one_rank(small):
    return small[1]["one_rank"]


def test_two_ranks_match_one_rank(small, one_rank):
    proc, dirs = small
    run_dir = dirs["two"]
    assert "2 ranks" in summary_line(proc, run_dir)
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


def test_sharding_options_keep_the_result(small, one_rank):
    """Activation checkpointing, CPU offload and no resharding change memory and speed, not the numbers."""
    assert_same_run(one_rank, small[1]["options"])


@pytest.fixture(scope="module")
def torchrun_job(tmp_path_factory, zoo_dirs):
    """A SMALL job under torchrun without hydra.run.dir: each rank resolves ${now:...} itself."""
    root = tmp_path_factory.mktemp("torchrun")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--nproc_per_node", "2", "-m", "kdsweep", *SMALL],
                          cwd=root, capture_output=True, text=True, timeout=600)
    return proc, [p for p in (root / "outputs" / "runs").glob("*/*") if p.is_dir()]


def test_torchrun_matches_the_builtin_launcher(torchrun_job, one_rank):
    proc, runs = torchrun_job
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("held-out CE: before") == 1  # one voice per job
    assert "2 ranks" in proc.stdout
    assert len(runs) == 1, runs
    assert_same_run(one_rank, runs[0])


def test_torchrun_ranks_agree_on_the_output_dir(torchrun_job):
    """Without hydra.run.dir each rank resolves ${now:...} itself; rank 0's directory must win."""
    proc, runs = torchrun_job
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(runs) == 1 and read_run(runs[0])["status"] == "completed"


def _worker_pids(parent_pid):
    """The rank processes the launcher started: the children of its forkserver (not the resource tracker)."""
    out = subprocess.run(["ps", "-e", "-ww", "-o", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    procs = [(int(pid), int(ppid), args) for pid, ppid, args in (line.split(None, 2) for line in out.splitlines())]
    servers = {pid for pid, ppid, args in procs if ppid == parent_pid and "multiprocessing.forkserver" in args}
    return [pid for pid, ppid, _ in procs if ppid in servers]


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
    # rank 0 killed: its record still says running; rank 1 killed: rank 0 recorded a lost peer (or, when its error
    # did not say so, a failure) — never completed
    assert read_run(run_dir)["status"] in ("running", "interrupted", "failed")

    kdsweep(*SMALL, "dist=fsdp2_local", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    record = read_run(run_dir)
    assert record["status"] == "completed" and record["attempts"] == 2
    assert 2 * ((reached - 1) // 2) <= record["start_step"] < 8
    assert [r["step"] for r in train_rows(run_dir)] == list(range(1, 9))
    assert_same_run(one_rank, run_dir)


@pytest.mark.parametrize("options", FUSED_OPTIONS)
def test_fused_loss_matches_dense(fused, options):
    """loss.impl=fused (hidden states projected chunk by chunk by the LoRA output layers, FSDP-sharded on 2 ranks)
    trains exactly as the dense logits path on one rank."""
    dirs = fused[1]
    assert_same_run(dirs["dense"], dirs[f"fused{FUSED_OPTIONS.index(options)}"])


def test_fused_loss_mixes_several_teachers_as_dense_logits_do(fused):
    """Two teachers of the student's tokenizer: the fused loss (each teacher's hidden states projected chunk by chunk,
    on 2 FSDP ranks) trains exactly as dense logits of both on one rank."""
    dirs = fused[1]
    assert [t["teacher"] for t in read_run(dirs["teachers_fused"])["teacher_targets"]["teachers"]] == \
        [t["teacher"] for t in read_run(dirs["teachers_dense"])["teacher_targets"]["teachers"]]
    assert_same_run(dirs["teachers_dense"], dirs["teachers_fused"])
    assert read_run(dirs["teachers_fused"])["objective"] != pytest.approx(read_run(dirs["dense"])["objective"], abs=1e-4)


TOO_MANY = len(os.sched_getaffinity(0)) + 1
TWO_STEPS = "train.max_steps=2"


# a full fine-tune whose every AdamW update (about lr) is far below half of bf16's resolution at the embedded
# student's weights (|w| ~ 0.02: half a unit in the last place is 6e-5): 12 of them accumulate in fp32 master weights
TINY_UPDATES = ["lora_rank=0", "lr=2.0e-6", "optim=adamw_constant", "optim.warmup_steps=0", "train.max_steps=12",
                "train.eval_every=12", "checkpoint.save_every=12", "checkpoint.export_adapter=false",
                "checkpoint.export_merged=false"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, zoo_dirs):
    """Smoke jobs, one multirun: fp32 on one rank; LoRA in bf16 on one and two ranks; full fine-tunes with tiny
    updates in bf16 (fp32 master weights) on one and two ranks, and in pure bf16."""
    root = tmp_path_factory.mktemp("smoke")
    return multirun(root, {
        "fp32": [TWO_STEPS],
        "bf16_two": [TWO_STEPS, "checkpoint.export_merged=false", "dist=fsdp2_local", "train.dtype=bf16"],
        "bf16": [TWO_STEPS, "checkpoint.export_merged=false", "train.dtype=bf16"],
        "full_bf16": [*TINY_UPDATES, "train.dtype=bf16"],
        "full_bf16_two": [*TINY_UPDATES, "train.dtype=bf16", "dist=fsdp2_local"],
        "full_pure": [*TINY_UPDATES, "train.dtype=bf16_pure"],
    }, "train=smoke", *QUIET)


def test_bf16_runs_train_near_fp32(smoke):
    """bf16 compute differs from fp32 by design; these runs must train and give a finite objective near it."""
    proc, dirs = smoke
    completed(proc)
    for name in ("bf16_two", "bf16"):
        assert read_run(dirs[name])["objective"] == pytest.approx(read_run(dirs["fp32"])["objective"], abs=0.05), name
        record = read_run(dirs[name])
        assert record["precision"]["student_parameters"].keys() == {"frozen bfloat16", "trainable float32"}, name
        assert record["teacher_targets"]["weights_dtype"] == ["bfloat16"], name


def _checkpoint(run_dir):
    """The step checkpoint's tensors (DCP, read whole) and the dtypes its metadata declares."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = run_dir / "checkpoints" / "step_00000012"
    declared = {k: str(m.properties.dtype) for k, m in FileSystemReader(ckpt).read_metadata().state_dict_metadata.items()
                if hasattr(m, "properties")}
    dcp_to_torch_save(ckpt, run_dir / "whole.pt")
    return torch.load(run_dir / "whole.pt", weights_only=False), declared


def test_a_bf16_full_fine_tune_keeps_fp32_master_weights_and_optimizer_state_and_pure_bf16_does_not(smoke, zoo_dirs):
    """train.dtype=bf16 on one and two ranks: every trainable weight and both AdamW moments are fp32 in the
    checkpoint (its DCP metadata says so), and 12 updates each far below bf16's resolution moved nearly every
    weight by their sum; in bf16_pure the same updates round away and nearly every weight is as it was."""
    from safetensors.torch import load_file

    proc, dirs = smoke
    completed(proc)
    start = load_file(zoo_dirs["student"] / "model.safetensors")  # fp32, as the zoo built it
    for name, master in (("full_bf16", "torch.float32"), ("full_bf16_two", "torch.float32"), ("full_pure", "torch.bfloat16")):
        whole, declared = _checkpoint(dirs[name])
        weights = {k: v for k, v in declared.items() if k.startswith("model.")}
        moments = {k: v for k, v in declared.items() if k.endswith(("exp_avg", "exp_avg_sq"))}
        assert weights and len(moments) == 2 * len(weights), name
        assert set(weights.values()) == set(moments.values()) == {master}, (name, set(weights.values()))
        moved, total, shift = 0, 0, []
        for key, w in whole["model"].items():
            w0 = start[key].to(w.dtype)
            moved += int((w != w0).sum())
            total += w.numel()
            shift.append((w.float() - start[key]).abs().mean())
        # measured: 91% moved by 0.57 x 12 lr on average in fp32 (the embeddings of tokens no step read get no
        # gradient), 1.5% in pure bf16 (the weights small enough for bf16 to resolve 2e-6)
        if master == "torch.float32":  # each update ~ lr: 12 of them, in fp32
            assert moved / total > 0.8, (name, moved / total)
            assert 0.3 * 12 * 2e-6 < float(torch.stack(shift).mean()) < 1.5 * 12 * 2e-6, name
        else:
            assert moved / total < 0.05, (name, moved / total)
    assert read_run(dirs["full_pure"])["precision"]["student_parameters"] == {
        "trainable bfloat16": sum(t.numel() for t in start.values())}


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


def test_multirun_of_one_then_two_ranks_in_one_process(small):
    """The second job's ranks start after this process trained the first job itself (no fork deadlock)."""
    _, dirs = small  # completed
    assert list(dirs)[:2] == ["one_rank", "two"]  # in this order, in one multirun
    one, two = read_run(dirs["one_rank"]), read_run(dirs["two"])
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert two["objective"] == pytest.approx(one["objective"], abs=1e-5)
