"""Real-architecture jobs from the command line: hub ids read from a Hugging Face cache built here (offline, on 1
and 2 ranks and in a SLURM job), a tied-embedding Qwen2 student under a padded Qwen2 teacher resumed after
kill -9 on 2 ranks, and the one-line refusals of what cannot work."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import QUIET, kdsweep, python_m, read_metrics, read_run
from helpers import WORDS, save_arch, word_lines, word_tokenizer
from test_resume import _wait_for_step

pytestmark = pytest.mark.slow

STUDENT, TEACHER, DATASET = "acme/qwen-student", "acme/qwen-teacher@v1", "acme/corpus"


def cache_model(hf_home: Path, repo: str, src: Path, revision: str = "main") -> Path:
    """Put ``src`` into the hub cache as huggingface_hub lays it out: content-addressed blobs, a snapshot of
    symlinks named by a commit hash, and a ref from ``revision`` to that commit."""
    org, name = repo.split("/")
    entry = hf_home / "hub" / f"models--{org}--{name}"
    commit = hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()
    snapshot = entry / "snapshots" / commit
    (entry / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        blob = entry / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / revision).write_text(commit)
    return snapshot


def cache_dataset(hf_home: Path, repo: str, data_file: Path) -> None:
    """What ``datasets.load_dataset(repo)`` leaves in its cache for a hub repository of JSON Lines files: built
    here by datasets' own JSON builder, placed where the cache names a hub dataset (<org>___<name>/default/...)."""
    code = (
        "import sys, shutil, os\n"
        "from datasets.packaged_modules.json.json import Json\n"
        "b = Json(data_files={'train': sys.argv[1]}, dataset_name=sys.argv[3], config_name='default', hash='0' * 40)\n"
        "b.download_and_prepare()\n"
        "dest = os.path.join(os.environ['HF_DATASETS_CACHE'], sys.argv[2] + '___' + sys.argv[3], 'default', '0.0.0')\n"
        "os.makedirs(dest)\n"
        "shutil.move(b.cache_dir, os.path.join(dest, '0' * 40))\n"
    )
    org, name = repo.split("/")
    env = {**os.environ, "HF_DATASETS_CACHE": str(hf_home / "datasets")}
    subprocess.run([sys.executable, "-c", code, str(data_file), org, name], env=env, check=True, capture_output=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    extra = tuple(f"w{i}" for i in range(40))
    tok = word_tokenizer(extra)
    lines = word_lines(200, [*WORDS, *extra], seed=1, longest=40)
    (root / "corpus.txt").write_text("\n".join(lines) + "\n")
    (root / "corpus.jsonl").write_text("".join(f'{{"text": "{line}"}}\n' for line in lines))
    # Qwen2.5-0.5B's shape in small: tied embeddings; its teacher has a padded output layer (like 7B vs 0.5B)
    hf_home = root / "hf_home"
    with ThreadPoolExecutor(1) as pool:  # datasets' builder runs in its own process while the models are saved
        dataset = pool.submit(cache_dataset, hf_home, DATASET, root / "corpus.jsonl")
        save_arch(root / "student", "qwen2", tok, hidden=64, layers=2, seed=0)
        save_arch(root / "teacher", "qwen2", tok, hidden=96, layers=2, seed=1, pad_vocab=16)
        save_arch(root / "gemma2", "gemma2", tok, hidden=32, layers=2, seed=0)
        cache_model(hf_home, STUDENT, root / "student")
        cache_model(hf_home, TEACHER.split("@")[0], root / "teacher", revision="v1")
        dataset.result()
    return root


def offline(models: Path) -> dict[str, str]:
    return {**os.environ, "HF_HOME": str(models / "hf_home"), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def run_kdsweep(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    return python_m(["kdsweep", *args], cwd=cwd, env=env, timeout=timeout)


JOB = ["data=text", "data.seq_len=32", "data.eval_fraction=0.1", "data.batch_size=4", "data.micro_batch_size=2", "train.max_steps=4",
       "train.eval_every=100", "checkpoint.save_every=0", "checkpoint.export_merged=false", "lr=3e-3", *QUIET]


@pytest.fixture(scope="module")
def offline_runs(models, tmp_path_factory):
    """Offline, side by side: the job on the local directories, and the same job on the hub ids on one and two
    ranks (one multirun over dist.nproc_per_node=1,2: jobs 0 and 1). The run directories and finished processes.
    One intra-op thread each (train.threads=1, which only lays a run out): with torch's default of one per core,
    two jobs on this 2-core machine wait on each other's threads at every step."""
    root = tmp_path_factory.mktemp("offline")
    env = offline(models)
    local, hub = root / "local", root / "hub"
    with ThreadPoolExecutor(1) as pool:
        local_done = pool.submit(run_kdsweep, [
            *JOB, f"model.path={models / 'student'}", f"teacher.path={models / 'teacher'}",
            f"data.datasets.0.path={models / 'corpus.txt'}", "train.threads=1", f"hydra.run.dir={local}"], root, env)
        hub_proc = run_kdsweep(["-m", *JOB, f"model.path={STUDENT}", f"teacher.path={TEACHER}",
                                f"data.datasets.0.path={DATASET}", "dist.nproc_per_node=1,2", "train.threads=1",
                                f"hydra.sweep.dir={hub}"], root, env)
        return {"local": (local, local_done.result()), "hub": {1: (hub / "0", hub_proc), 2: (hub / "1", hub_proc)}}


def test_hub_ids_resolve_from_the_cache_offline_on_one_and_two_ranks(offline_runs):
    local, proc = offline_runs["local"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = read_run(local)["objective"]
    for ranks in (1, 2):
        run_dir, proc = offline_runs["hub"][ranks]
        assert proc.returncode == 0, proc.stderr[-3000:]
        record = read_run(run_dir)
        assert record["world_size"] == ranks and record["config"]["model"]["path"] == STUDENT
        assert record["objective"] == pytest.approx(expected, abs=1e-5), ranks


@pytest.mark.usefixtures("slurm_cluster")
def test_hub_ids_resolve_in_a_slurm_job(models, offline_runs, tmp_path):
    sweep = tmp_path / "sweep"
    env = offline(models)  # with the cluster's SLURM_CONF and PATH, which the slurm_cluster fixture set
    proc = run_kdsweep(["-m", *JOB, f"model.path={STUDENT}", f"teacher.path={TEACHER}",
                        f"data.datasets.0.path={DATASET}", "hydra/launcher=submitit_slurm", "cluster=local_cpu",
                        f"hydra.sweep.dir={sweep}"], tmp_path, env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = read_run(sweep / "0")
    assert record["status"] == "completed" and record["world_size"] == 2 and record["environment"]["slurm"]
    local, _ = offline_runs["hub"][1]  # the same job on one local rank, offline
    assert record["objective"] == pytest.approx(read_run(local)["objective"], abs=1e-5)


@pytest.mark.parametrize("args,expected,hint", [
    (["model.path=acme/missing", f"teacher.path={TEACHER}"],
     "model.path=acme/missing is neither a local directory nor in the Hugging Face cache", "hf download acme/missing"),
    ([f"model.path={STUDENT}", "teacher.path=acme/qwen-teacher@v2"],
     "teacher.path=acme/qwen-teacher@v2 is neither a local directory nor in the Hugging Face cache",
     "hf download acme/qwen-teacher --revision v2"),
    ([f"model.path={STUDENT}", f"teacher.path={TEACHER}", "data.datasets.0.path=acme/no-such-data"],
     "data.datasets[0].path: acme/no-such-data is not a local path, and datasets cannot load acme/no-such-data", None),
])
def test_a_missing_cache_entry_is_one_line(models, tmp_path, args, expected, hint):
    proc = run_kdsweep([*JOB, f"data.datasets.0.path={DATASET}", *args, f"hydra.run.dir={tmp_path / 'run'}"],
                       tmp_path, offline(models))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()
    if hint is not None:
        assert f"({hint})" in lines[0]
        # the suggested command is well-formed: run against a cache that holds that repo, it resolves it
        filled = hint.replace("acme/missing", STUDENT).replace("v2", "v1").split()
        done = subprocess.run([str(Path(sys.executable).parent / filled[0]), *filled[1:]], env=offline(models),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "snapshots" in done.stdout, done.stdout + done.stderr


RESUME = ["model.path={root}/student", "teacher.path={root}/teacher", "data=text", "data.eval_fraction=0.1",
          "data.datasets.0.path={root}/corpus.txt", "data.seq_len=32", "data.batch_size=4", "data.micro_batch_size=2",
          "lora_rank=0", "lr=2e-3", "train.max_steps=30", "train.eval_every=10", "checkpoint.save_every=3",
          "checkpoint.export_adapter=false", "dist.nproc_per_node=2", *QUIET]


def test_tied_student_under_a_padded_teacher_on_two_ranks_resumes_after_kill_9(models, tmp_path):
    args = [a.format(root=models) for a in RESUME]
    reference = tmp_path / "reference"
    with ThreadPoolExecutor(1) as pool:  # the uninterrupted reference runs beside the killed run and its resume
        reference_done = pool.submit(kdsweep, *args, f"hydra.run.dir={reference}", cwd=tmp_path)

        kill_at = random.Random(time.time_ns()).randint(4, 24)
        print(f"killing the job's process group at step {kill_at}")
        run_dir = tmp_path / "killed"
        proc = subprocess.Popen([sys.executable, "-m", "kdsweep", *args, f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        reached = _wait_for_step(run_dir, kill_at, proc, time.time() + 300)
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks at once, as when a node dies
        proc.wait()
        assert read_run(run_dir)["status"] == "running"

        kdsweep(*args, f"hydra.run.dir={run_dir}", cwd=tmp_path)
        reference_done.result()
    record = read_run(run_dir)
    assert record["status"] == "completed" and record["attempts"] == 2 and record["world_size"] == 2
    assert 3 * ((reached - 1) // 3) <= record["start_step"] < 30
    ref_rows = [r for r in read_metrics(reference) if r["kind"] == "train"]
    got_rows = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in got_rows] == list(range(1, 31))
    for a, b in zip(ref_rows, got_rows):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["step"]  # bit-identical
    assert record["objective"] == read_run(reference)["objective"]
    # the exported model keeps its tied embeddings and scores the objective
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(record["exports"]["merged"])
    assert merged.lm_head.weight is merged.model.embed_tokens.weight


def test_cli_all_linear_string_and_a_zoo_teacher_beside_a_student_directory(tmp_path, zoo_dirs):
    """``teacher=tiny`` beside a directory holding the embedded tokenizer is accepted (the tokenizers are compared,
    not assumed different), and ``model.target_modules=all-linear`` is a string, not a list."""
    run_dir = tmp_path / "run"
    kdsweep(f"model.path={zoo_dirs['student']}", "teacher=tiny", "model.target_modules=all-linear", "train=smoke",
            "train.max_steps=2", "train.threads=1", "checkpoint.export_merged=false", *QUIET,
            f"hydra.run.dir={run_dir}", cwd=tmp_path)
    log = (run_dir / "kdsweep.log").read_text()
    assert ("LoRA reached 14 modules (model.target_modules=all-linear): q_proj ×2, k_proj ×2, v_proj ×2, o_proj ×2, "
            "gate_proj ×2, up_proj ×2, down_proj ×2") in log
    assert read_run(run_dir)["status"] == "completed"


def test_the_default_loss_is_fused_unless_a_model_transforms_its_logits(models, offline_runs, tmp_path):
    """loss.impl=auto, chosen before launch and recorded: fused for models whose logits are their output layer's
    (the Qwen2 pair's offline job, which leaves loss.impl to auto), chunked for Gemma 2 (it soft-caps its logits after
    the output layer, which only the logits paths can do)."""
    local, proc = offline_runs["local"]
    assert proc.returncode == 0 and "loss.impl" not in " ".join(JOB), proc.stderr[-3000:]
    record = read_run(local)
    assert record["status"] == "completed" and record["config"]["loss"]["impl"] == "fused"
    run_dir = tmp_path / "gemma2"
    kdsweep(f"model.path={models}/gemma2", f"teacher.path={models}/gemma2", "train=smoke", "train.max_steps=2",
            "data.seq_len=32", "train.threads=1", "checkpoint.export_merged=false", *QUIET,
            f"hydra.run.dir={run_dir}", cwd=tmp_path)
    record = read_run(run_dir)
    assert record["status"] == "completed" and record["config"]["loss"]["impl"] == "chunked"


@pytest.mark.parametrize("args,expected", [
    (["model.path={root}/gemma2", "teacher.path={root}/gemma2", "loss.impl=fused"],
     "loss.impl=fused: the model (Gemma2ForCausalLM) applies final_logit_softcapping=30.0 to its logits"),
    (["model.path={root}/student", "teacher.path={root}/teacher", "model.target_modules=[no_such_module]"],
     "model.target_modules: Qwen2ForCausalLM has no module named no_such_module; its linear layers are q_proj, k_proj, "
     "v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head"),
    (["model.path={root}/student", "teacher.path={root}/teacher", "model.target_modules=[no_such_module]",
      "dist.nproc_per_node=2"], "Qwen2ForCausalLM has no module named no_such_module"),
    (["model.path={root}/student", "teacher=tiny"],  # a word-level tokenizer cannot be aligned across tokenizers
     "/student: its tokenizer writes tokens in a convention kdsweep cannot read back into text"),
])
def test_what_cannot_work_is_one_line(models, tmp_path, args, expected):
    run_dir = tmp_path / "run"
    proc = kdsweep(*[a.format(root=models) for a in args], "data.seq_len=32", *QUIET, f"hydra.run.dir={run_dir}",
                   cwd=tmp_path, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr and not run_dir.exists()
