"""The fixes kdsweep's one-line errors suggest work when typed as they say.

Each case: the overrides that are refused, the line's words, and the overrides it tells the user to pass. Checks
of the configuration are run as the app runs them (compose, resolve, validate: what ``python -m kdsweep`` does
before any job starts); the ones a job makes when it starts (binding the master address, finding a GPU, cutting
rows) run the real command.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from hydra import compose, initialize_config_dir

from conftest import QUIET, kdsweep, read_run
from helpers import save_arch, word_tokenizer
from test_cross_tokenizer import TEACHER_TEMPLATE

pytestmark = pytest.mark.slow

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def models(tmp_path_factory, other_teacher):
    from test_bad_input import without_template

    root = tmp_path_factory.mktemp("hint_models")
    save_arch(root / "gemma2", "gemma2", word_tokenizer(), hidden=32, layers=2)
    save_arch(root / "llama", "llama", word_tokenizer(), hidden=32, layers=2)
    without_template(other_teacher, root / "other_no_template")  # the second embedded teacher carries one
    return root


CONFIG = {
    "temperature": (["loss.temperature=0"], "pass loss.temperature=1.0", ["loss.temperature=1.0"]),
    "empty_targets": (["model.target_modules=[]"], "pass model.target_modules=all-linear",
                      ["model.target_modules=all-linear"]),
    "stream_needs_text": (["data=instruction", "data.datasets.0.path={root}/x.jsonl", "data.datasets.0.format=instruction",
                           "data.sequences=stream", "data.seq_len=256"], "use data.sequences=pack", ["data.sequences=pack"]),
    "sample_divergence": (["teacher.logits=cache", "loss.divergence=tvd"], "use loss.divergence=forward_kl",
                          ["loss.divergence=forward_kl"]),
    "cache_temperature": (["teacher.logits=cache", "teacher.cache.temperature=2.0"], "use teacher.cache.method=full",
                          ["teacher.cache.method=full"]),
    "fused_softcap": (["model.path={root}/gemma2", "teacher.path={root}/gemma2", "loss.impl=fused", "data.seq_len=32"],
                      "use loss.impl=chunked", ["loss.impl=chunked"]),
    "no_such_target": (["model.path={root}/llama", "teacher.path={root}/llama", "data.seq_len=32",
                        "model.target_modules=[no_such]"], "use a preset: all-linear", ["model.target_modules=all-linear"]),
    "mixed_tokenizers": (["model.path={root}/llama", "data.seq_len=32"],  # beside the embedded teacher
                         "pick a teacher with the same tokenizer as the model", ["teacher.path={root}/llama"]),
    "teachers_weights_zero": (["teachers=[{{zoo:tiny-teacher,weight:0}},{{zoo:tiny-teacher-other,weight:0}}]"],
                              "teachers: the weights [0.0, 0.0] sum to 0; give at least one teacher a positive weight, "
                              "e.g. teachers.0.weight=1", ["teachers.0.weight=1"]),
    "teachers_negative_weight": (["teachers=[{{zoo:tiny-teacher,weight:1}},{{zoo:tiny-teacher-other,weight:-1}}]"],
                                 "teachers.1.weight=-1.0 is negative", ["teachers.1.weight=0.5"]),
    "cross_chat_template": (["teacher.path={root}/other_no_template", "data=chat",
                             "data.datasets.0.path={root}/x_chat.jsonl",
                             "data.chat_template={root}/x_student.jinja", "data.seq_len=128"],
                            "set teacher.chat_template", ["teacher.chat_template={root}/x_teacher.jinja"]),
    "teachers_rollout": (["teachers=[{{zoo:tiny-teacher}},{{zoo:tiny-teacher-other}}]", "rollout=on_policy"],
                         "generation with several teachers is not supported yet; pass lmbda=0 rollout.seq_kd=false",
                         ["lmbda=0", "rollout.seq_kd=false"]),
}


def validate(overrides: list[str], tmp_path):
    """What the app does before any job: compose, resolve, convert and check (models, LoRA targets, data)."""
    from kdsweep.app import conf_dir, validate_composed

    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    return validate_composed(cfg, str(tmp_path / "run"))


@pytest.mark.parametrize("case", sorted(CONFIG))
def test_a_configuration_hint_typed_as_it_says_validates(case, models, tmp_path):
    from kdsweep.config import ConfigError

    (tmp_path / "x.jsonl").write_text('{"instruction": "say hi", "input": "", "output": "hi"}\n' * 200)
    chat = {"messages": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi"}]}
    (tmp_path / "x_chat.jsonl").write_text((json.dumps(chat) + "\n") * 200)
    for name, template in (("student", CHATML), ("teacher", TEACHER_TEMPLATE)):
        (tmp_path / f"x_{name}.jinja").write_text(template)
    bad, words, fix = CONFIG[case]
    bad = [a.format(root=models if "{root}/x" not in a else tmp_path) for a in bad]
    fix = [f.format(root=models if "{root}/x" not in f else tmp_path) for f in fix]
    with pytest.raises(ConfigError) as e:
        validate(bad, tmp_path)
    assert words in str(e.value) and "\n" not in str(e.value)
    fixed = [a for a in bad if a.split("=")[0] not in {f.split("=")[0] for f in fix}] + fix
    validate(fixed, tmp_path)


RUNTIME = {
    "master_addr": (["dist.nproc_per_node=2", "dist.master_addr=10.255.255.1"], "pass dist.master_addr=127.0.0.1",
                    ["dist.master_addr=127.0.0.1"]),
    "cuda": (["train.device=cuda"], "pass train.device=cpu", ["train.device=cpu"]),
}


@pytest.mark.parametrize("case", sorted(RUNTIME))
def test_a_launch_hint_typed_as_it_says_runs(case, tmp_path, zoo_dirs):
    bad, words, fix = RUNTIME[case]
    # one intra-op thread (it only lays a run out): the fixed run shares the machine with the refused one
    common = ["train=smoke", "train.max_steps=1", "checkpoint.export_merged=false", "train.threads=1", *QUIET]
    fixed = [a for a in bad if a.split("=")[0] not in {f.split("=")[0] for f in fix}] + fix
    with ThreadPoolExecutor(1) as pool:  # the refused command and the fixed one are independent: side by side
        fixed_done = pool.submit(kdsweep, *common, *fixed, f"hydra.run.dir={tmp_path / 'fixed'}", cwd=tmp_path)
        proc = kdsweep(*common, *bad, f"hydra.run.dir={tmp_path / 'bad'}", cwd=tmp_path, check=False)
        fixed_done.result()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and words in lines[0], proc.stderr
    assert read_run(tmp_path / "fixed")["status"] == "completed"
