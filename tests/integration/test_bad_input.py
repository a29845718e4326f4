"""Bad input: one line naming the field and the fix, exit code 2, nothing trained or written."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import kdsweep
from helpers import save_hf_model, word_tokenizer


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, zoo_dirs, other_teacher):
    """The cases' files. The embedded models are built first: a case's job that built one would log it."""
    root = tmp_path_factory.mktemp("bad")
    (root / "empty.txt").write_text("\n\n")
    (root / "empty.jsonl").write_text("")
    (root / "no_text.jsonl").write_text('{"content": "x"}\n' * 3)
    (root / "no_output.jsonl").write_text('{"instruction": "say hi", "input": "", "response": "hi"}\n' * 3)
    (root / "instructions.jsonl").write_text('{"instruction": "say hi", "input": "", "output": "hi"}\n' * 3)
    (root / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n' * 3)
    (root / "chat_no_messages.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"text": "x"}\n')
    (root / "table.xlsx").write_text("x")
    (root / "two_rows.txt").write_text("the cat\nsat on the mat\n")
    (root / "chat.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    (root / "not_a_model").mkdir()
    (root / "not_a_model" / "weights.bin").write_text("x")
    save_hf_model(root / "student_a", word_tokenizer())
    save_hf_model(root / "teacher_b", word_tokenizer(extra_words=("zebra", "yak")), hidden=48)
    save_hf_model(root / "lossy_teacher", lowercasing_tokenizer(), max_positions=256)
    without_template(zoo_dirs["student"], root / "student_no_template")
    without_template(other_teacher, root / "other_no_template")
    return root


def without_template(model_dir, out):
    """A copy of an embedded model whose tokenizer has no chat template (as a base model's often has none)."""
    import json
    import shutil

    shutil.copytree(model_dir, out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def lowercasing_tokenizer():
    """The second embedded teacher's tokenizer, made to lowercase what it reads (a lossy normalisation)."""
    from tokenizers import normalizers
    from transformers import AutoTokenizer

    from kdsweep.models import zoo

    tok = AutoTokenizer.from_pretrained(zoo.tokenizer_dir(zoo.TOKENIZER_OF["tiny-teacher-other"]))
    tok.backend_tokenizer.normalizer = normalizers.Lowercase()
    return tok


CASES = {
    "kd_ratio": (["kd_ratio=1.5"], "loss.kd_ratio"),
    "lora_rank": (["lora_rank=-1"], "model.lora_rank"),
    "lr": (["lr=0"], "optim.lr"),
    "temperature": (["loss.temperature=0"], "loss.temperature"),
    "missing_path": (["model.path=/does/not/exist"], "model.path=/does/not/exist does not exist"),
    "not_hf_dir": (["model.path={root}/not_a_model"], "not a Hugging Face model directory"),
    "tokenizers": (["model.path={root}/student_a", "teacher.path={root}/teacher_b", "data.seq_len=16"],
                   "model.path={root}/student_a: its tokenizer writes tokens in a convention kdsweep cannot read back"),
    "cross_tokenizer_lossy": (["teacher.path={root}/lossy_teacher"],
                              "teacher.path={root}/lossy_teacher: its tokenizer does not give the data's text back as it "
                              "is (it reads 'In the beginning God created"),
    "cross_tokenizer_rollout": (["teacher=tiny_other", "rollout.seq_kd=true", "data=instruction",
                                 "data.datasets.0.path={root}/instructions.jsonl"],
                                "generation with a teacher of another tokenizer"),
    "cross_tokenizer_chat": (["teacher.path={root}/other_no_template", "data=chat", "data.datasets.0.path={root}/chat.jsonl",
                              "data.chat_template={root}/chat.jinja"],
                             "teacher: chat data needs the teacher's own chat template, and its tokenizer has none; set "
                             "teacher.chat_template"),
    "cross_tokenizer_mixed_formats": (["teacher=tiny_other", "data=mixture", "data.datasets.0.path={root}/instructions.jsonl",
                                       "data.datasets.1.path={root}/chat.jsonl", "data.chat_template={root}/chat.jinja"],
                                      "data.datasets[0] is not chat but data.datasets[1] is"),
    "teachers_chat": (["teachers=[{{zoo:tiny-teacher}},{{zoo:tiny-teacher-other}}]", "data=chat",
                       "data.datasets.0.path={root}/chat.jsonl", "data.chat_template={root}/chat.jinja"],
                      "data.datasets[0].format=chat: among several teachers, one with another tokenizer than the "
                      "student's cannot read chat rows in its own template yet"),
    "teachers_weights": (["teachers=[{{zoo:tiny-teacher,weight:0}},{{zoo:tiny-teacher-other,weight:0}}]"],
                         "teachers: the weights [0.0, 0.0] sum to 0"),
    "cross_tokenizer_weights": (["teacher=tiny_other", "loss.gold_matched_weight=0.5"],
                                "loss.gold_matched_weight=0.5 and loss.gold_unmatched_weight=None: give both"),
    "empty_data": (["data=text", "data.datasets.0.path={root}/empty.txt"], "data.datasets[0].path: {root}/empty.txt is empty"),
    "empty_jsonl": (["data=instruction", "data.datasets.0.path={root}/empty.jsonl"], "{root}/empty.jsonl is empty"),
    "missing_text_column": (["data=text", "data.datasets.0.path={root}/no_text.jsonl"], "no column 'text' (columns: content)"),
    "missing_column": (["data=instruction", "data.datasets.0.path={root}/no_output.jsonl"],
                       "no_output.jsonl row 1: no column 'output' (columns: instruction, input, response)"),
    "unknown_format": (["data=text", "data.datasets.0.path={root}/no_text.jsonl", "data.datasets.0.format=markdown"],
                       "data.datasets[0].format=markdown is an unknown data format; use one of text, instruction, chat"),
    "unknown_file_kind": (["data=text", "data.datasets.0.path={root}/table.xlsx"], "has unknown kind '.xlsx'"),
    "missing_file": (["data=text", "data.datasets.0.path={root}/nope.jsonl"], "data.datasets[0].path: {root}/nope.jsonl does not exist"),
    "chat_without_messages": (["data=chat", "data.datasets.0.path={root}/chat_no_messages.jsonl", "data.chat_template={root}/chat.jinja"],
                              "chat_no_messages.jsonl row 2: a chat row needs a non-empty list of messages"),
    "no_chat_template": (["model.path={root}/student_no_template", "data=chat", "data.datasets.0.path={root}/chat.jsonl"],
                         "data.datasets[0].format=chat needs a chat template and the tokenizer of "
                         "{root}/student_no_template has none"),
    "weights_not_positive": (["data=mixture", "data.datasets.0.path={root}/no_output.jsonl", "data.datasets.1.path={root}/chat.jsonl",
                              "data.datasets.0.weight=0", "data.datasets.1.weight=0"], "data.datasets weights sum to 0"),
    "negative_weight": (["data=mixture", "data.datasets.0.path={root}/no_output.jsonl", "data.datasets.1.path={root}/chat.jsonl",
                         "data.datasets.1.weight=-1"], "data.datasets[1].weight=-1.0 must be a finite number >= 0"),
    "no_source_to_change": (["data.datasets.0.path=/data/a.jsonl"],
                            "data.datasets.0.path: data=embedded has 0 source(s) in data.datasets, so no source 0"),
    "no_field_to_change": (["data=text", "data.datasets.0.output_column=response"],
                           "source 0 of data=text has no output_column to change; pass the whole list"),
    "nothing_left_to_train": (["data=text", "data.datasets.0.path={root}/two_rows.txt", "data.eval_fraction=0.75"],
                              "two_rows.txt holds 2 row(s), too few to hold out data.eval_fraction=0.75"),
    "stream_needs_text": (["data=instruction", "data.datasets.0.path={root}/no_output.jsonl", "data.sequences=stream"],
                          "data.sequences=stream joins plain text, but data.datasets[0] has format instruction"),
    "no_eval_split": (["data.eval_fraction=0"], "no eval split"),
    "seq_len": (["data.seq_len=4096"], "data.seq_len=4096 is beyond"),
    "unknown_key": (["foo=1"], "unknown config key 'foo'"),
    "unknown_nested_key": (["train.foo=1"], "unknown config key 'train.foo'"),
    "unknown_added_key": (["+train.foo=1"], "unknown config key 'train.foo'"),
    "removed_num_chunks": (["loss.num_chunks=4"], "loss.num_chunks was removed: the loss splits into as many chunks as "
                                                   "loss.chunk_mb"),
    "chunk_mb": (["loss.chunk_mb=0"], "loss.chunk_mb=0.0 must be > 0"),
    "fp16": (["train.dtype=fp16"], "train.dtype"),
    "required_files": (["data=instruction"], "data.datasets[0].path is required but not set; pass data.datasets.0.path=<value>"),
    "knob_conflict": (["loss.kd_ratio=0.9"], "loss.kd_ratio=0.9 disagrees with the sweep knob kd_ratio=0.5"),
    "downstream_task": (["downstream.tasks=[no_such_task]"],
                        "downstream.tasks=['no_such_task']: lm-eval knows no task 'no_such_task'; use "
                        "kdsweep_next_word (shipped), a task of `lm-eval ls tasks`, or one in a YAML directory given "
                        "with downstream.include=[DIR]"),
    "downstream_limit": (["downstream.limit=0"], "downstream.limit=0 must be >= 1 (null: every item of each task)"),
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


def test_a_bad_grid_point_is_one_line_before_any_job(tmp_path):
    sweep = tmp_path / "sweep"
    proc = kdsweep("-m", "kd_ratio=0.5,1.5", "train=smoke", f"hydra.sweep.dir={sweep}", cwd=tmp_path, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "grid point 1 (kd_ratio=1.5 train=smoke)" in lines[0] and "loss.kd_ratio=1.5 is outside [0, 1]" in lines[0]
    assert not (sweep / "0").exists(), "the good point must not have run either"


@pytest.mark.slow
def test_resuming_another_config_or_with_resume_off_is_refused_and_keeps_the_run(tmp_path, zoo_dirs):
    run_dir = tmp_path / "run"
    job = ("train=smoke", "train.max_steps=2", "train.threads=1")  # one intra-op thread: fast on a busy machine
    kdsweep(*job, "logger=quiet", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    record = (run_dir / "run.json").read_text()
    refused = ((["kd_ratio=0.7"], "different training config (loss.kd_ratio: 0.5 -> 0.7)"),
               (["checkpoint.resume=false"], "checkpoint.resume=false but"))
    with ThreadPoolExecutor(2) as pool:  # both refusals at once: each is refused before it could write anything
        procs = list(pool.map(lambda args: kdsweep(*job, *args, f"hydra.run.dir={run_dir}", cwd=tmp_path, check=False),
                              [args for args, _ in refused]))
    for proc, (_, expected) in zip(procs, refused):
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr
        assert (run_dir / "run.json").read_text() == record, "a refused resume must leave the run as it was"
    # what does not change the weights (eval cadence, ranks, logging) may change on resume
    kdsweep(*job, "train.eval_every=1", "logger=quiet", f"hydra.run.dir={run_dir}", cwd=tmp_path)
