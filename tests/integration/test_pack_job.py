"""A packed job (kdsweep.pack.run_pack): K trials in one process over one student base and one teacher pass, each
member's run.json, metrics and exported adapter equal to the same trial run alone; what cannot be packed is one line
before anything runs."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import read_metrics, read_run
from helpers import WORDS, save_hf_model, word_tokenizer

pytestmark = pytest.mark.slow

# Per-member knobs: LoRA rank and alpha, learning rate and schedule, kd_ratio, divergence, temperature, β, clipping.
MEMBERS = [
    dict(model=dict(lora_rank=4, lora_alpha=8.0), optim=dict(lr=3e-2, max_grad_norm=1.0), loss=dict(kd_ratio=0.0)),
    dict(model=dict(lora_rank=8, lora_alpha=16.0), optim=dict(lr=1e-2, max_grad_norm=0.0, weight_decay=0.1),
         loss=dict(kd_ratio=0.5, divergence="forward_kl", temperature=2.0)),
    dict(model=dict(lora_rank=16, lora_alpha=16.0), optim=dict(lr=3e-2, warmup_steps=2),
         loss=dict(kd_ratio=1.0, divergence="jsd", beta=0.3)),
    dict(model=dict(lora_rank=8, lora_alpha=32.0), optim=dict(lr=1e-2, schedule="constant"),
         loss=dict(kd_ratio=0.5, divergence="jsd", beta=0.5, temperature=1.5)),
]
LOGITS = ["live", "cache", "teachers"]  # a live teacher, a `full` cache, two teachers across tokenizers
TRAIN_FIELDS = ("loss", "ce", "kd", "kl", "grad_norm", "lr", "tokens")
EVAL_FIELDS = ("student_ce", "kl", "teacher_ce", "tokens")


@pytest.fixture(scope="module")
def root(tmp_path_factory, zoo_dirs, other_teacher):
    root = tmp_path_factory.mktemp("pack_job")
    for name, path in (("zoo_student", zoo_dirs["student"]), ("zoo_teacher", zoo_dirs["teacher"]),
                       ("zoo_other", other_teacher)):  # byte-level BPE models, two tokenizers: teachers across them
        (root / name).symlink_to(path)
    rng = random.Random(0)
    (root / "docs.jsonl").write_text("".join(
        json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.choice([3, 5, 9, 17, 30])))}) + "\n" for _ in range(60)))
    tok = word_tokenizer()
    save_hf_model(root / "student", tok, hidden=32, layers=2, seed=0)
    save_hf_model(root / "teacher", tok, hidden=48, layers=2, seed=1)
    torch.set_num_threads(1)
    return root


def config(root: Path, name: str, member: dict, logits: str = "live", merged: bool = False):
    """A member's config; ``logits``: live, cache (``full``), or teachers (the embedded student with two live
    teachers, one of another tokenizer, weighted 1 and 2)."""
    from kdsweep.config.schema import (CheckpointConfig, DataConfig, DatasetConfig, LoggerConfig, LossConfig,
                                       OptimConfig, RunConfig, StudentConfig, TeacherCacheConfig, TeacherConfig,
                                       TeacherMember, TrainConfig)

    several = logits == "teachers"
    teachers = (TeacherMember(path=str(root / "zoo_teacher"), weight=1.0),
                TeacherMember(path=str(root / "zoo_other"), weight=2.0)) if several else ()
    return RunConfig(
        teachers=teachers,
        output_dir=str(root / "runs" / name),
        model=StudentConfig(path=str(root / ("zoo_student" if several else "student")),
                            target_modules=("q_proj", "v_proj", "lm_head"),
                            **member["model"]),
        teacher=TeacherConfig(path=str(root / "teacher"), logits="live" if several else logits,
                              cache=TeacherCacheConfig(method="full", dir=str(root / "cache"))),
        data=DataConfig(datasets=(DatasetConfig(path=str(root / "docs.jsonl")),), seq_len=24, batch_size=4,
                        micro_batch_size=2, eval_batch_size=4, eval_fraction=0.15, cache_dir=str(root / "data")),
        loss=LossConfig(**member["loss"]),
        optim=OptimConfig(**member["optim"]),
        train=TrainConfig(max_steps=6, eval_every=2, device="cpu", threads=1),
        logger=LoggerConfig(progress_bar=False),
        checkpoint=CheckpointConfig(save_every=3, export_adapter=True, export_merged=merged),
    )


def assert_same_run(packed: Path, alone: Path, tol: float = 1e-5, status: str = "completed") -> None:
    """The same status, objective and metrics rows within ``tol``, and (completed) the same exported adapter."""
    a, b = read_run(packed), read_run(alone)
    assert a["status"] == b["status"] == status
    assert a["objective"] == pytest.approx(b["objective"], abs=tol)
    rows_a, rows_b = read_metrics(packed), read_metrics(alone)
    assert [(r["kind"], r["step"]) for r in rows_a] == [(r["kind"], r["step"]) for r in rows_b]
    for ra, rb in zip(rows_a, rows_b):
        for k in TRAIN_FIELDS if ra["kind"] == "train" else EVAL_FIELDS:
            assert ra[k] == pytest.approx(rb[k], abs=tol, nan_ok=True), (ra["kind"], ra["step"], k)
    if status != "completed":
        return
    from safetensors.torch import load_file

    wa, wb = (load_file(d / "final" / "adapter" / "adapter_model.safetensors") for d in (packed, alone))
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=tol, rtol=0)


_ALONE: dict[tuple[Path, str], list[Path]] = {}


def alone(root: Path, logits: str) -> list[Path]:
    """The run directories of :data:`MEMBERS` each trained alone on one rank (once per module and ``logits``)."""
    from kdsweep.train import run

    if (root, logits) not in _ALONE:
        cfgs = [config(root, f"{logits}-alone-{i}", m, logits, merged=i == 0) for i, m in enumerate(MEMBERS)]
        for cfg in cfgs:
            run(cfg)
        _ALONE[root, logits] = [Path(cfg.output_dir) for cfg in cfgs]
    return _ALONE[root, logits]


@pytest.mark.parametrize("logits", LOGITS)
def test_each_member_of_a_pack_is_the_trial_run_alone(root, logits):
    """Four members (ranks 4/8/16/8, two learning rates and schedules, kd_ratio 0/0.5/1, forward KL and JSD at three
    temperatures, clipping on and off) trained as one pack give the rows, objective and adapter of each trial alone,
    with a live teacher, a ``full`` cache, and two teachers one of which has another tokenizer; member 0 also exports
    its merged student (a copy: the base the others share is left as it was)."""
    from kdsweep.pack import run_pack

    packed = [config(root, f"{logits}-pack-{i}", m, logits, merged=i == 0) for i, m in enumerate(MEMBERS)]
    results = run_pack(packed)
    assert [r.status for r in results] == ["completed"] * len(MEMBERS)
    if logits == "teachers":  # the second teacher's targets came across tokenizers
        targets = read_run(Path(packed[1].output_dir))["teacher_targets"]["teachers"]
        assert len(targets) == 2 and "cross_tokenizer" in targets[1] and "cross_tokenizer" not in targets[0]
    for i, solo in enumerate(alone(root, logits)):
        assert_same_run(Path(packed[i].output_dir), solo)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    exported = Path(packed[2].output_dir) / "final" / "adapter"
    base = root / ("zoo_student" if logits == "teachers" else "student")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), exported)
    assert model.peft_config["default"].r == 16
    merged = AutoModelForCausalLM.from_pretrained(Path(packed[0].output_dir) / "final" / "merged")
    assert merged.config.vocab_size == model.config.vocab_size


TWO_RANKS = """
import os, sys, traceback
from pathlib import Path
sys.path[:0] = [{tests!r}, str(Path({tests!r}).parent)]
import torch
from kdsweep import app
from kdsweep.pack import run_pack
from test_pack_job import LOGITS, MEMBERS, config
torch.set_num_threads(1)
root = Path({root!r})
every = {{logits: [config(root, f"{{logits}}-ranks2-{{i}}", m, logits, merged=i == 0) for i, m in enumerate(MEMBERS)]
         for logits in LOGITS}}
with app.SESSION.joined(every["live"][0]) as env:
    for logits, cfgs in every.items():  # one pack after another in one process group, as a warm worker runs them
        try:
            results = run_pack(cfgs, dist=env)
            said = "ok" if [r.status for r in results] == ["completed"] * len(cfgs) else repr(results)
        except Exception:
            said = traceback.format_exc()
        (root / f"{{logits}}-ranks2.rank{{os.environ['RANK']}}.said").write_text(said)
"""


@pytest.fixture(scope="module")
def two_rank_packs(root):
    """:data:`MEMBERS` as one pack on two ranks for each of :data:`LOGITS`, one torchrun for the three (after each
    trial alone: the data and the cache are made by one process, as a sweep's prepare does)."""
    import subprocess
    import sys

    for logits in LOGITS:
        alone(root, logits)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    script = TWO_RANKS.format(tests=str(Path(__file__).parent), root=str(root))
    return subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "--no-python", sys.executable, "-c",
                           script], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("logits", LOGITS)
def test_each_member_of_a_two_rank_pack_is_the_trial_run_alone(root, two_rank_packs, logits):
    """The same four members as one pack on two ranks (torchrun: each member's student sharded as its trial's, the
    rows split between the ranks) give each trial's rows, objective and exported adapter alone on one rank, within
    1e-5, with a live teacher, a ``full`` cache, and two teachers one of which has another tokenizer."""
    for rank in (0, 1):  # what each rank said of this pack, then the torchrun's own exit
        said = root / f"{logits}-ranks2.rank{rank}.said"
        assert said.exists() and said.read_text() == "ok", (said.read_text() if said.exists() else "") + \
            two_rank_packs.stderr[-3000:]
    assert two_rank_packs.returncode == 0, two_rank_packs.stderr[-3000:]
    for i, solo in enumerate(alone(root, logits)):
        packed = root / "runs" / f"{logits}-ranks2-{i}"
        assert read_run(packed)["world_size"] == 2
        assert_same_run(packed, solo)


def test_a_pack_runs_the_teacher_once_per_micro_batch(root):
    """The live teacher computes each training micro-batch's and each held-out batch's targets once for every member
    that reads them: the first member's sources count them, the others count only their own evaluation before
    training (each member's baseline is its own outside a sweep)."""
    from kdsweep.pack import run_pack

    members = [config(root, f"count-pack-{i}", m) for i, m in enumerate(MEMBERS[1:])]
    run_pack(members)
    solo = alone(root, "live")[1]  # MEMBERS[1] alone
    costs = [read_run(d)["cost"] for d in [solo, *(Path(c.output_dir) for c in members)]]
    computed = [c["teacher_tokens_computed"] for c in costs]
    cfg = members[0]
    positions = cfg.train.max_steps * cfg.data.batch_size * cfg.data.seq_len  # packed rows: no padding
    evaluations = sum(r["kind"] == "eval" for r in read_metrics(solo))  # the baseline's included
    assert evaluations >= 3 and (computed[0] - positions) % evaluations == 0
    assert computed[1] == computed[0] and computed[2:] == [(computed[0] - positions) // evaluations] * 2
    # each member's device-seconds are its share of the job's: together the job's wall, each a third of it
    shares = [c["device_seconds"] for c in costs[1:]]
    assert shares == pytest.approx([costs[1]["trial_seconds"] / 3] * 3, rel=0.02)


class PruneAt:
    """A reporter that prunes its trial at its first evaluation at or after ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def report(self, step: int, evals: dict) -> bool:
        return step >= self.step


def test_members_that_are_pruned_or_turn_nan_leave_and_the_others_are_unchanged(root, monkeypatch):
    """A member pruned at its first evaluation, one whose loss turns non-finite and one whose backward runs out of
    memory in its third step leave the pack (pruned; failed with the reason in its run.json); the other two train on,
    equal to each trial alone, and the pruned one's rows are its solo run's."""
    import kdsweep.train.step as step
    from kdsweep.pack import run_pack
    from kdsweep.train import run

    nan = dict(MEMBERS[2], optim=dict(lr=float("inf"), max_grad_norm=0.0))
    oom = dict(MEMBERS[0], loss=dict(kd_ratio=0.0, temperature=3.0))  # its temperature marks it (kd_ratio=0: unused)
    members = [MEMBERS[1], MEMBERS[2], nan, MEMBERS[3], oom]
    real, calls = step.micro_batch_backward, []

    def out_of_memory(student, targets, batch, loss_cfg, *args):
        calls.append(loss_cfg.temperature)
        if loss_cfg.temperature == 3.0 and calls.count(3.0) == 5:  # step 3's first micro-batch (2 per step)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real(student, targets, batch, loss_cfg, *args)

    monkeypatch.setattr(step, "micro_batch_backward", out_of_memory)
    cfgs = [config(root, f"leave-pack-{i}", m) for i, m in enumerate(members)]
    reporters = [PruneAt(10**9), PruneAt(2), PruneAt(10**9), PruneAt(10**9), PruneAt(10**9)]
    results = run_pack(cfgs, reporters=reporters)
    monkeypatch.undo()
    assert [getattr(r, "status", None) for r in results] == ["completed", "pruned", None, "completed", None]
    failed = read_run(Path(cfgs[2].output_dir))
    assert failed["status"] == "failed" and "not finite" in failed["error"]
    assert isinstance(results[2], FloatingPointError)
    assert isinstance(results[4], torch.OutOfMemoryError)
    lost = read_run(Path(cfgs[4].output_dir))
    assert lost["status"] == "failed" and lost["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert [r["step"] for r in read_metrics(Path(cfgs[4].output_dir)) if r["kind"] == "train"] == [1, 2]
    assert read_run(Path(cfgs[1].output_dir))["steps"] == 2
    solo = config(root, "leave-alone-1", members[1])
    run(solo, reporter=reporters[1])
    assert_same_run(Path(cfgs[1].output_dir), Path(solo.output_dir), status="pruned")
    for i in (0, 3):  # never pruned (PruneAt(10**9)): the trial alone is alone()'s run of that member
        assert_same_run(Path(cfgs[i].output_dir), alone(root, "live")[MEMBERS.index(members[i])])


@pytest.mark.parametrize("change, hint", [
    (dict(train=dict(seed=1)), "train.seed=1"),
    (dict(data=dict(batch_size=8)), "data.batch_size=8"),
    (dict(model=dict(lora_rank=0)), "model.lora_rank=0"),
    (dict(loss=dict(impl="chunked")), "loss.impl='chunked'"),
])
def test_what_cannot_be_packed_is_one_line_before_anything_runs(root, change, hint):
    from kdsweep.pack import run_pack

    cfgs = [config(root, f"bad-{i}", m) for i, m in enumerate(MEMBERS[:2])]
    section, values = next(iter(change.items()))
    cfgs[1] = replace(cfgs[1], **{section: replace(getattr(cfgs[1], section), **values)})
    with pytest.raises(ValueError) as e:
        run_pack(cfgs)
    assert hint in str(e.value) and "\n" not in str(e.value)
    assert not (root / "runs" / "bad-0").exists()  # refused before any member started


TWO_TEACHERS = "teachers=[{zoo:tiny-teacher,weight:1},{zoo:tiny-teacher-other,weight:2}]"  # one across tokenizers


@pytest.mark.parametrize("ranks,teacher", [(1, []), (2, [TWO_TEACHERS])], ids=["1-live", "2-teachers"])
def test_a_grid_packed_from_the_command_line_is_the_grid_run_job_by_job(tmp_path, ranks, teacher):
    """``-m kd_ratio=0,0.5 hydra/launcher=kdsweep_pack`` trains the grid as one pack on the embedded default (on 1
    rank, and on 2 local ranks it spawns with two teachers, one of which has another tokenizer): every job's
    directory, run.json, objective and rows as Hydra's basic launcher gives them, job by job. (A pack on 2 ranks with
    a live teacher and a ``full`` cache: :func:`test_each_member_of_a_two_rank_pack_is_the_trial_run_alone`.)"""
    from conftest import QUIET, kdsweep

    grid = ["-m", "kd_ratio=0,0.5", "lr=3e-3", "lora_rank=4", "train.max_steps=3", "train.eval_every=2",
            "checkpoint.save_every=0", "checkpoint.export_merged=false", f"dist.nproc_per_node={ranks}",
            "train.threads=1", *teacher, *QUIET]
    packed = kdsweep(*grid, f"hydra.sweep.dir={tmp_path / 'packed'}", "hydra/launcher=kdsweep_pack", cwd=tmp_path)
    kdsweep(*grid, f"hydra.sweep.dir={tmp_path / 'basic'}", cwd=tmp_path)
    assert packed.stdout.count("pack member") == 2 and "sweep " in packed.stdout
    for job in range(2):
        a, b = read_run(tmp_path / "packed" / str(job)), read_run(tmp_path / "basic" / str(job))
        assert a["overrides"] == b["overrides"] and a["status"] == "completed"
        assert a["objective"] == pytest.approx(b["objective"], abs=1e-5) and a["world_size"] == ranks
        targets = a["teacher_targets"]
        if teacher and teacher[0] == TWO_TEACHERS:  # the second teacher's targets came across tokenizers
            assert [("cross_tokenizer" in t) for t in targets["teachers"]] == [False, True]
        else:
            assert targets["source"] == "live"
        rows_a, rows_b = (read_metrics(tmp_path / arm / str(job)) for arm in ("packed", "basic"))
        assert [(r["kind"], r["step"]) for r in rows_a] == [(r["kind"], r["step"]) for r in rows_b]
        for ra, rb in zip(rows_a, rows_b):
            for k in TRAIN_FIELDS if ra["kind"] == "train" else EVAL_FIELDS:
                assert ra[k] == pytest.approx(rb[k], abs=1e-5, nan_ok=True), (job, ra["kind"], ra["step"], k)
        assert sorted(p.name for p in (tmp_path / "packed" / str(job)).iterdir()) == \
            sorted(p.name for p in (tmp_path / "basic" / str(job)).iterdir())  # the same files, job by job
        assert (tmp_path / "packed" / str(job) / "final" / "adapter" / "adapter_model.safetensors").exists()


def test_a_packed_grid_over_a_shared_knob_is_one_line_before_any_job(tmp_path):
    from conftest import QUIET, kdsweep

    proc = kdsweep("-m", "train.seed=0,1", "train.max_steps=2", f"hydra.sweep.dir={tmp_path / 's'}",
                   "hydra/launcher=kdsweep_pack", *QUIET, cwd=tmp_path, check=False)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [lines[-1]] and lines[-1].startswith("kdsweep: error: hydra/launcher=kdsweep_pack: ")
    assert "train.seed=1" in lines[-1] and not (tmp_path / "s" / "0").exists()


def test_an_error_of_the_pack_step_is_recorded_by_every_member(root, monkeypatch):
    """The shared step failing (here: injected into its third call) is every member's error: each run.json says
    failed with it, and run_pack raises it."""
    import kdsweep.pack.job as job
    from kdsweep.pack import run_pack

    real, calls = job.train_step, []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the pack's step failed (injected)")
        return real(*args, **kw)

    monkeypatch.setattr(job, "train_step", failing)
    cfgs = [config(root, f"boom-{i}", m) for i, m in enumerate(MEMBERS[1:3])]
    with pytest.raises(RuntimeError, match="injected"):
        run_pack(cfgs)
    for cfg in cfgs:
        record = read_run(Path(cfg.output_dir))
        assert record["status"] == "failed" and "injected" in record["error"]


KILLED = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
import torch
import kdsweep.pack.job as job
from test_pack_job import MEMBERS, config
real, calls = job.train_step, []
def dying(*args, **kw):
    calls.append(1)
    if len(calls) == 5:  # after step 4: the members' checkpoints of step 3 are written
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kw)
job.train_step = dying
torch.set_num_threads(1)
job.run_pack([config(Path({root!r}), f"killed-{{i}}", m) for i, m in enumerate(MEMBERS[1:])])
"""


def test_a_pack_killed_mid_run_resumes_every_member_from_its_checkpoint(root):
    """kill -9 of a pack after step 4 (checkpoints at step 3), then the same pack again: every member resumes from
    its checkpoint and ends with the rows and objective of the trial run alone, no row twice."""
    import subprocess
    import sys

    from kdsweep.pack import run_pack

    script = KILLED.format(tests=str(Path(__file__).parent), root=str(root))
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent, capture_output=True, text=True,
                          env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert proc.returncode == -9, proc.stderr[-2000:]
    cfgs = [config(root, f"killed-{i}", m) for i, m in enumerate(MEMBERS[1:])]
    assert all(read_run(Path(c.output_dir))["status"] == "running" for c in cfgs)
    results = run_pack(cfgs)
    assert [r.status for r in results] == ["completed"] * 3
    for i, solo in enumerate(alone(root, "live")[1:]):  # MEMBERS[1:] alone
        assert read_run(Path(cfgs[i].output_dir))["start_step"] == 3
        assert_same_run(Path(cfgs[i].output_dir), solo)


@pytest.mark.parametrize("logits", ["live", "cache"])
def test_the_memory_plan_counts_what_the_pack_holds(root, logits):
    """The plan's counts are the real models': the student's base and the live teacher read as a job reads them,
    the largest member's adapter built as peft builds it (its weights, gradients and AdamW moments in fp32)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from kdsweep.pack.plan import activation_bytes, loss_path_bytes, plan

    cfgs = [config(root, f"plan-{i}", m, logits) for i, m in enumerate(MEMBERS)]
    memory = plan(cfgs, torch.device("cpu"), device_gb=2.0)
    size = lambda model: sum(p.numel() * p.element_size() for p in model.parameters())  # noqa: E731
    student = AutoModelForCausalLM.from_pretrained(root / "student")
    base, vocab = size(student), student.config.vocab_size
    teacher = size(AutoModelForCausalLM.from_pretrained(root / "teacher")) if logits == "live" else 0
    adapters = [get_peft_model(AutoModelForCausalLM.from_pretrained(root / "student"), LoraConfig(
        r=m["model"]["lora_rank"], lora_alpha=m["model"]["lora_alpha"], target_modules=["q_proj", "v_proj", "lm_head"]))
        for m in MEMBERS]
    trainable = max(sum(p.numel() for p in a.parameters() if p.requires_grad) for a in adapters)
    assert memory.per_member == 4 * 4 * trainable  # rank 16's
    step = activation_bytes(48, 2, 32, False, 4) + loss_path_bytes(48, vocab, cfgs[0].loss.impl, 128.0,
                                                                   logits == "live")
    assert memory.fixed == teacher + base + step and memory.usable == 1.5e9


def test_a_grid_the_memory_plan_says_will_not_fit_is_one_line_before_any_job(tmp_path):
    """1 MB usable, far less than the embedded pair's weights: refused with the plan's numbers, nothing started."""
    from conftest import kdsweep

    proc = kdsweep("-m", "kd_ratio=0,0.5", "hydra/launcher=kdsweep_pack", "dist.device_memory_gb=0.00133",
                   f"hydra.sweep.dir={tmp_path / 'grid'}", cwd=tmp_path, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("kdsweep: error: hydra/launcher=kdsweep_pack: a pack of 2 will not fit, says the "
                               "memory plan: a pack of 2 needs 0.05")
    assert lines[0].endswith("not even one trial fits this device")
    assert not (tmp_path / "grid").exists()
