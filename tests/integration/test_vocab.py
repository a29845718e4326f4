"""A teacher with a padded output layer (same tokenizer, more logit rows) distils without any setting."""

import pytest

from conftest import QUIET, kdsweep, read_run

pytestmark = pytest.mark.slow


def test_padded_teacher_vocab_is_aligned_automatically(tmp_path, zoo_dirs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    teacher = AutoModelForCausalLM.from_pretrained(zoo_dirs["teacher"])
    vocab = teacher.config.vocab_size
    teacher.resize_token_embeddings(vocab + 64)  # like Qwen2.5-7B (152064 rows) vs 0.5B (151936)
    padded = tmp_path / "padded_teacher"
    teacher.save_pretrained(padded)
    AutoTokenizer.from_pretrained(zoo_dirs["teacher"]).save_pretrained(padded)

    # one multirun, one process: job 0 under the padded teacher, job 1 (the reference) under the embedded unpadded
    # teacher (teacher.path=null: the default teacher=tiny). One intra-op thread (it only lays the runs out): torch's
    # default of one per core makes every step wait on preempted threads on a busy 2-core machine.
    sweep = tmp_path / "sweep"
    kdsweep("-m", f"model.path={zoo_dirs['student']}", f"teacher.path={padded},null",
            "train=smoke", "train.max_steps=2", "train.threads=1", *QUIET, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    run_dir, reference = sweep / "0", sweep / "1"
    assert read_run(reference)["config"]["teacher"]["path"] is None
    record = read_run(run_dir)
    assert record["status"] == "completed" and record["config"]["teacher"]["path"] == str(padded)
    # the padded rows change nothing: the teacher's held-out CE equals the unpadded teacher's
    # the padded rows are cut away: same teacher CE and the same training as with the unpadded teacher
    assert record["eval_after"]["teacher_ce"] == pytest.approx(read_run(reference)["eval_after"]["teacher_ce"], abs=1e-6)
    assert record["objective"] == pytest.approx(read_run(reference)["objective"], abs=1e-5)
