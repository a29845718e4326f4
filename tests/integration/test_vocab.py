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

    run_dir = tmp_path / "run"
    kdsweep(f"model.path={zoo_dirs['student']}", f"teacher.path={padded}",
            "train=smoke", "train.max_steps=2", *QUIET, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    record = read_run(run_dir)
    assert record["status"] == "completed"
    # the padded rows change nothing: the teacher's held-out CE equals the unpadded teacher's
    reference = tmp_path / "reference"
    kdsweep("train=smoke", "train.max_steps=2", *QUIET, f"hydra.run.dir={reference}", cwd=tmp_path)
    # the padded rows are cut away: same teacher CE and the same training as with the unpadded teacher
    assert record["eval_after"]["teacher_ce"] == pytest.approx(read_run(reference)["eval_after"]["teacher_ce"], abs=1e-6)
    assert record["objective"] == pytest.approx(read_run(reference)["objective"], abs=1e-5)
