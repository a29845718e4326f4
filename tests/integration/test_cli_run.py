"""`python -m kdsweep` end to end on the embedded default: outputs, exports that load, multirun."""

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import QUIET, kdsweep, read_metrics, read_run
from helpers import once

pytestmark = pytest.mark.slow


def smoke(tmp_path_factory):
    """``python -m kdsweep train=smoke`` (the embedded default at kd_ratio=0.5), run once per session: (its run
    directory, the finished process). test_slurm_jobs compares its SLURM grid point kd_ratio=0.5 with this run.
    One intra-op thread (train.threads=1, which only lays a run out): with torch's default of one per core, a
    step on a busy 2-core machine waits on preempted threads (seconds instead of a fraction of one)."""
    def build():
        root = tmp_path_factory.mktemp("smoke")
        run_dir = root / "run"
        return run_dir, kdsweep("train=smoke", "train.threads=1", *QUIET, f"hydra.run.dir={run_dir}", cwd=root)

    return once("smoke_run", build)


@pytest.fixture(scope="module")
def background(tmp_path_factory, zoo_dirs):
    """The kd_ratio multirun and the full fine-tune, started side by side as soon as a test asks (each is one
    process whose start-up is single-threaded, so they overlap each other and the smoke run): (directory, future
    of the finished process) for each. One intra-op thread each (train.threads=1, which only lays a run out): with
    torch's default of one per core, jobs side by side on a 2-core machine wait on each other's threads."""
    root = tmp_path_factory.mktemp("cli")
    with ThreadPoolExecutor(2) as pool:
        multirun = pool.submit(
            kdsweep, "-m", "kd_ratio=0.0,0.5,1.0", "train=smoke", "train.max_steps=2",
            "checkpoint.export_merged=false", "train.threads=1", *QUIET, f"hydra.sweep.dir={root / 'sweep'}", cwd=root)
        full = pool.submit(kdsweep, "lora_rank=0", "lr=1e-3", "train=smoke", "train.max_steps=2", "train.threads=1",
                           *QUIET, f"hydra.run.dir={root / 'full'}", cwd=root)
        yield {"multirun": (root / "sweep", multirun), "full": (root / "full", full)}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, background):
    return smoke(tmp_path_factory)  # while the background commands run


def test_prints_before_after_and_where_outputs_are(smoke_run):
    run_dir, proc = smoke_run
    m = re.search(r"held-out CE: before ([\d.]+) -> after ([\d.]+)", proc.stdout)
    assert m, proc.stdout
    record = read_run(run_dir)
    assert record["status"] == "completed"
    assert float(m.group(2)) == pytest.approx(record["objective"], abs=1e-4)
    assert float(m.group(1)) == pytest.approx(record["eval_before"]["student_ce"], abs=1e-4)
    assert f"outputs: {run_dir}" in proc.stdout
    assert record["config"]["loss"]["kd_ratio"] == 0.5 and record["overrides"][0] == "train=smoke"
    assert record["environment"]["packages"]["torch"] and "git_sha" in record["environment"]
    assert (run_dir / "kdsweep.log").read_text().count("held-out CE after") == 1


def test_metrics_hold_every_step_and_eval(smoke_run):
    run_dir, _ = smoke_run
    rows = read_metrics(run_dir)
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in evals] == [0, 3, 6]
    for r in train:
        assert r["loss"] == pytest.approx(0.5 * r["ce"] + 0.5 * r["kd"], rel=1e-6)
        assert r["tokens"] == 16 * 128 and r["tokens_per_s"] > 0 and r["grad_norm"] > 0 and r["lr"] > 0


def _eval_ce(model, run_dir):
    """Held-out CE of ``model`` on the run's own eval split, computed independently of kdsweep's loop."""
    from transformers import AutoTokenizer

    from kdsweep.data.text import embedded_corpus, tokenize_to_sequences

    tok = AutoTokenizer.from_pretrained(run_dir / "final" / "merged")
    seqs = tokenize_to_sequences(tok, embedded_corpus(0.05, 1234).eval, 128)
    with torch.no_grad():
        logits = model(input_ids=seqs[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), seqs[:, 1:].reshape(-1)).item(), logits


def test_adapter_and_merged_model_load_and_match_the_trained_student(smoke_run, zoo_dirs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir, _ = smoke_run
    assert not (run_dir / "final" / "merged" / "adapter_config.json").exists()
    base = AutoModelForCausalLM.from_pretrained(zoo_dirs["student"])
    with_adapter = PeftModel.from_pretrained(base, run_dir / "final" / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "final" / "merged").eval()
    ce_adapter, logits_adapter = _eval_ce(with_adapter, run_dir)
    ce_merged, logits_merged = _eval_ce(merged, run_dir)
    assert torch.allclose(logits_adapter, logits_merged, atol=1e-4)
    objective = read_run(run_dir)["objective"]
    # The trained student's held-out CE, as the run measured it, is reproduced by both exports.
    assert ce_adapter == pytest.approx(objective, abs=1e-5)
    assert ce_merged == pytest.approx(objective, abs=1e-5)
    untrained = AutoModelForCausalLM.from_pretrained(zoo_dirs["student"]).eval()
    assert _eval_ce(untrained, run_dir)[0] == pytest.approx(read_run(run_dir)["eval_before"]["student_ce"], abs=1e-5)
    assert objective < read_run(run_dir)["eval_before"]["student_ce"]


def test_export_merges_a_run_s_adapter_into_a_model_plain_transformers_loads_as_the_trained_student(
        background, zoo_dirs, tmp_path):
    """`kdsweep export` of the multirun's kd_ratio=0.5 job (which kept its adapter only): the merged model and its
    tokenizer load with plain transformers and give the trained student's logits (the base with the run's adapter,
    through peft) on the held-out rows, and reproduce the CE the run measured; the card says how it was made."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kdsweep.data.text import embedded_corpus, tokenize_to_sequences

    sweep, proc = background["multirun"]
    assert proc.result().returncode == 0
    run_dir = sweep / "1"
    assert not (run_dir / "final" / "merged").exists()
    out = kdsweep("export", str(run_dir), "--out", str(tmp_path / "shipped"), cwd=tmp_path)
    shipped = tmp_path / "shipped" / "1"
    assert f"{shipped}: merged/" in out.stdout
    model = AutoModelForCausalLM.from_pretrained(shipped / "merged").eval()
    tokenizer = AutoTokenizer.from_pretrained(shipped / "merged")
    seqs = tokenize_to_sequences(tokenizer, embedded_corpus(0.05, 1234).eval, 128)
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(zoo_dirs["student"]),
                                        run_dir / "final" / "adapter").eval()
    with torch.no_grad():
        merged_logits, trained_logits = (m(input_ids=seqs[:, :-1]).logits for m in (model, trained))
    assert (merged_logits - trained_logits).abs().max().item() < 1e-5
    ce = torch.nn.functional.cross_entropy(merged_logits.reshape(-1, merged_logits.shape[-1]), seqs[:, 1:].reshape(-1))
    record = read_run(run_dir)
    assert ce.item() == pytest.approx(record["objective"], abs=1e-5)
    assert (shipped / "adapter" / "adapter_model.safetensors").exists() and (shipped / "adapter" / "tokenizer.json").exists()
    chat = [{"role": "user", "content": "In the beginning"}, {"role": "assistant", "content": "God created"}]
    for d in ("merged", "adapter"):  # the tokenizers render conversations as the student's template does
        rendered = AutoTokenizer.from_pretrained(shipped / d).apply_chat_template(chat, tokenize=False)
        assert rendered == "user: In the beginning\nassistant: God created</s>\n", rendered
    card = (shipped / "README.md").read_text()
    assert "kd_ratio 0.5," in card and f"base student: `{zoo_dirs['student']}`" in card
    assert f"student CE {record['objective']:.4g}" in card
    bad = kdsweep("export", str(sweep), cwd=tmp_path, check=False)  # a multirun directory: no sweep.json, no run.json
    assert bad.returncode == 2 and bad.stderr.strip().endswith(
        "holds neither sweep.json nor run.json: pass a sweep directory or a run directory")


def test_multirun_over_kd_ratio_runs_three_jobs(background):
    sweep, proc = background["multirun"]
    proc = proc.result()
    assert proc.stdout.count("held-out CE: before") == 3
    records = [read_run(sweep / str(i)) for i in range(3)]
    assert [r["config"]["loss"]["kd_ratio"] for r in records] == [0.0, 0.5, 1.0]
    assert all(r["status"] == "completed" and isinstance(r["objective"], float) for r in records)
    # kd_ratio changes training, so the three objectives differ
    assert len({round(r["objective"], 6) for r in records}) == 3
    # kd_ratio=0: its training steps ran no teacher (only its evaluations did), their KL is not measured (null),
    # and its evaluations measured KL and the teacher's CE as the others did
    free, kd = records[0], records[1]
    assert "without the teacher" in free["teacher_targets"]["training_steps"] and "training_steps" not in kd["teacher_targets"]
    assert free["cost"]["train_tokens"] == kd["cost"]["train_tokens"] > 0
    assert free["cost"]["teacher_tokens_computed"] == kd["cost"]["teacher_tokens_computed"] - kd["cost"]["train_tokens"]
    rows = read_metrics(sweep / "0")
    assert all(r["kl"] is None and r["kd"] == 0.0 for r in rows if r["kind"] == "train")
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals and all(r["kl"] > 0 and r["teacher_ce"] > 0 for r in evals)
    assert [r["teacher_ce"] for r in evals] == [r["teacher_ce"] for r in read_metrics(sweep / "1") if r["kind"] == "eval"]


def test_full_fine_tune_with_lora_rank_zero(background):
    run_dir, proc = background["full"]
    proc.result()  # the command succeeded
    record = read_run(run_dir)
    assert record["status"] == "completed" and record["config"]["model"]["lora_rank"] == 0
    assert (run_dir / "final" / "merged" / "model.safetensors").exists() and not (run_dir / "final" / "adapter").exists()


def test_no_collection_of_a_job_scans_what_it_imported(tmp_path, zoo_dirs):
    """(kdsweep.startup) A fresh ``python -m kdsweep`` imports torch, transformers and peft with the garbage
    collector paused and freezes them: no full collection of the job scans them. Before, seven full collections
    during those imports and the trial's first one scanned up to 400k objects each: 0.8 of a 2-step job's 5.6
    CPU-s on this machine."""
    code = ("import gc, json, runpy, sys\n"
            "scans = []\n"
            "gc.callbacks.append(lambda phase, info: phase == 'start' and info['generation'] == 2"
            " and scans.append(len(gc.get_objects())))\n"
            "sys.argv = ['kdsweep', *sys.argv[1:]]\n"
            "try:\n"
            "    runpy.run_module('kdsweep', run_name='__main__', alter_sys=True)\n"
            "finally:\n"
            "    seen = {'scans': scans, 'frozen': gc.get_freeze_count(), 'peft': 'peft' in sys.modules}\n"
            "    print('GC', json.dumps(seen))\n")
    proc = subprocess.run([sys.executable, "-c", code, "train=smoke", "train.max_steps=1", *QUIET,
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.split("GC ", 1)[1])
    assert seen["peft"] and seen["frozen"] > 200_000  # what the job imported, frozen
    assert seen["scans"] and max(seen["scans"]) < 100_000, seen["scans"]  # 400k before
