"""Bad input: one line naming the field and the fix, exit code 2, nothing trained or written."""

import pytest

from conftest import kdsweep
from helpers import save_hf_model, word_tokenizer


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    (root / "empty.txt").write_text("\n\n")
    (root / "no_text.jsonl").write_text('{"content": "x"}\n')
    (root / "not_a_model").mkdir()
    (root / "not_a_model" / "weights.bin").write_text("x")
    save_hf_model(root / "student_a", word_tokenizer())
    save_hf_model(root / "teacher_b", word_tokenizer(extra_words=("zebra", "yak")), hidden=48)
    return root


CASES = {
    "kd_ratio": (["kd_ratio=1.5"], "loss.kd_ratio"),
    "lora_rank": (["lora_rank=-1"], "model.lora_rank"),
    "lr": (["lr=0"], "optim.lr"),
    "temperature": (["loss.temperature=0"], "loss.temperature"),
    "missing_path": (["model.path=/does/not/exist"], "model.path=/does/not/exist does not exist"),
    "not_hf_dir": (["model.path={root}/not_a_model"], "not a Hugging Face model directory"),
    "tokenizers": (["model.path={root}/student_a", "teacher.path={root}/teacher_b", "data.seq_len=16"], "different tokenizers"),
    "empty_data": (["data.train_files=[{root}/empty.txt]"], "data.train_files: {root}/empty.txt is empty"),
    "bad_jsonl": (["data.train_files=[{root}/no_text.jsonl]"], "'text' field"),
    "no_eval_split": (["data.eval_fraction=0"], "no eval split"),
    "seq_len": (["data.seq_len=4096"], "data.seq_len=4096 is beyond"),
    "unknown_key": (["foo=1"], "unknown config key 'foo'"),
    "unknown_nested_key": (["train.foo=1"], "unknown config key 'train.foo'"),
    "unknown_added_key": (["+train.foo=1"], "unknown config key 'train.foo'"),
    "fp16": (["train.dtype=fp16"], "train.dtype"),
    "required_files": (["data=text_files"], "data.train_files is required"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_clear_line_and_nothing_written(case, dirs, tmp_path):
    args, expected = CASES[case]
    run_dir = tmp_path / "run"
    proc = kdsweep(*[a.format(root=dirs) for a in args], f"hydra.run.dir={run_dir}", cwd=tmp_path, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("kdsweep: error: "), proc.stderr
    assert expected.format(root=dirs) in lines[0]
    assert not run_dir.exists(), "a rejected command must not leave a run directory"
    assert "Traceback" not in proc.stdout + proc.stderr
