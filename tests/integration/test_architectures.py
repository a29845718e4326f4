"""Every architecture users bring, as student and as teacher: LoRA and full fine-tune, chunked and fused loss,
1 and 2 FSDP ranks, the loss in one chunk (the plain graph) and in several, exported adapter and merged model.

Tiny random-init models of each family are built from transformers' own config classes and saved in HF format
(tests/helpers.py). Each cell is a real ``kdsweep.train.run`` (the function a job runs on every rank) with the
family's student distilled from a bigger teacher of the same family; the 2-rank cells run in two spawned gloo
ranks, all cells in one process group, so the whole matrix costs a few minutes. A cell either equals the 1-rank
chunked run of its architecture and mode, or is refused by the job's preflight with one line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from helpers import ARCHS, WORDS, chunk_mb_for, gloo_ranks, run_each, save_arch, word_lines, word_tokenizer

pytestmark = pytest.mark.slow

MODES = ("lora", "full")
IMPLS = ("chunked", "fused")
ROWS = (*ARCHS, "qwen2_padded_teacher")  # a Qwen2 student under a Qwen2 teacher whose output layer is padded
SPLIT = chunk_mb_for(3, 2 * 16, 22)
"""The loss budget of every cell but the reference (1 rank, chunked: the plain graph, one chunk): each micro-batch
(2 rows of 16 tokens, 22 tokens of vocabulary or more) in 3 chunks or more, so each cell checks a chunk path."""


def _arch(row: str) -> str:
    return "qwen2" if row == "qwen2_padded_teacher" else row


def cell_config(root: Path, row: str, mode: str, impl: str, ranks: int):
    from kdsweep.config.schema import (CheckpointConfig, DataConfig, DatasetConfig, LoggerConfig, LossConfig, OptimConfig,
                                       RunConfig, StudentConfig, TeacherConfig, TrainConfig)

    teacher = root / ("teacher_qwen2_padded" if row == "qwen2_padded_teacher" else f"teacher_{row}")
    return RunConfig(
        output_dir=str(root / "cells" / f"{row}-{mode}-{impl}-{ranks}"),
        # LoRA everywhere peft's all-linear reaches, plus the output layer (tied to the embeddings in Qwen and Gemma)
        model=StudentConfig(path=str(root / f"student_{_arch(row)}"), lora_rank=4 if mode == "lora" else 0,
                            target_modules=("all-linear", "lm_head")),
        teacher=TeacherConfig(path=str(teacher)),
        data=DataConfig(datasets=(DatasetConfig(path=str(root / "corpus.txt")),), seq_len=16, batch_size=4,
                        micro_batch_size=2, eval_batch_size=8, cache_dir=str(root / "data_cache")),
        loss=LossConfig(kd_ratio=0.5, impl=impl,
                        chunk_mb=LossConfig.chunk_mb if (impl, ranks) == ("chunked", 1) else SPLIT),
        optim=OptimConfig(lr=1e-2 if mode == "lora" else 3e-3),
        train=TrainConfig(max_steps=3, eval_every=100, device="cpu", threads=1),
        logger=LoggerConfig(progress_bar=False),
        checkpoint=CheckpointConfig(save_every=0),
    )


def _preflight(cfg) -> str | None:
    """What the job's launch would refuse (its one line), or None."""
    from kdsweep.config import ConfigError
    from kdsweep.data.check import preflight_data
    from kdsweep.models.check import preflight_models, preflight_targets

    try:
        preflight_models(cfg)
        preflight_targets(cfg, zoo_too=True)
        preflight_data(cfg)
    except ConfigError as e:
        return str(e)
    return None


def build_models(root: Path) -> None:
    """Every architecture's student and teacher, and the corpus, in ``root`` (tests/loops/gloo_ranks.py too)."""
    extra = tuple(f"w{i}" for i in range(40))
    tok = word_tokenizer(extra)
    (root / "corpus.txt").write_text("\n".join(word_lines(120, [*WORDS, *extra][:30], seed=0)) + "\n")
    for arch in ARCHS:
        save_arch(root / f"student_{arch}", arch, tok, hidden=32, layers=2, seed=0)
        save_arch(root / f"teacher_{arch}", arch, tok, hidden=48, layers=2, seed=1)
    save_arch(root / "teacher_qwen2_padded", "qwen2", tok, hidden=48, layers=2, seed=1, pad_vocab=16)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Build every model once, run every cell; {(row, mode, impl, ranks): run.json or the refusal}."""
    from kdsweep.train import run

    root = tmp_path_factory.mktemp("archs")
    build_models(root)

    cells = {(row, mode, impl, ranks): cell_config(root, row, mode, impl, ranks)
             for row in ROWS for mode in MODES for impl in IMPLS for ranks in (1, 2)}
    results = {key: _preflight(cfg) for key, cfg in cells.items()}
    torch.set_num_threads(1)
    for key, cfg in cells.items():
        if key[3] == 1 and results[key] is None:
            Path(cfg.output_dir).mkdir(parents=True)
            handler = logging.FileHandler(Path(cfg.output_dir) / "kdsweep.log")  # as the job's rank 0 logs
            root_logger, level = logging.getLogger(), logging.getLogger().level
            root_logger.addHandler(handler)
            root_logger.setLevel(logging.INFO)
            try:
                run(cfg)
            finally:
                root_logger.removeHandler(handler)
                root_logger.setLevel(level)
    two = [cfg for key, cfg in cells.items() if key[3] == 2 and results[key] is None]
    gloo_ranks(run_each, two, tmp_path=root)  # every runnable 2-rank cell, in one process group
    for key, cfg in cells.items():
        if results[key] is None:
            results[key] = json.loads((Path(cfg.output_dir) / "run.json").read_text())
    return root, cells, results


def test_every_cell_equals_the_one_rank_chunked_run_or_is_refused_in_one_line(matrix):
    _, cells, results = matrix
    refused = {key: r for key, r in results.items() if isinstance(r, str)}
    # Gemma 2 soft-caps its logits after the output layer; the fused loss cannot, and says so before launch
    assert set(refused) == {("gemma2", mode, "fused", ranks) for mode in MODES for ranks in (1, 2)}
    for message in refused.values():
        assert "\n" not in message and "loss.impl=fused" in message and "final_logit_softcapping" in message
        assert "use loss.impl=chunked" in message
    for key, record in results.items():
        if key in refused:
            continue
        row, mode, _, _ = key
        reference = results[(row, mode, "chunked", 1)]
        assert record["status"] == "completed", key
        assert record["world_size"] == key[3]
        assert record["objective"] == pytest.approx(reference["objective"], abs=1e-5), key
        assert record["eval_after"]["teacher_ce"] == pytest.approx(reference["eval_after"]["teacher_ce"], abs=1e-5), key
        assert record["eval_after"]["student_ce"] < record["eval_before"]["student_ce"], key  # it learned


def test_the_exports_reproduce_the_objective(matrix):
    """The adapter loads in peft over the student's base, the merged model in transformers; both score the run's
    objective on the held-out rows (a LoRA on a tied output layer is merged into an untied copy)."""
    import copy
    import functools

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kdsweep.config.schema import LossConfig
    from kdsweep.data.rows import Rows
    from kdsweep.distributed import single_process
    from kdsweep.train.trial import eval_batches_of_rank
    from kdsweep.teacher.live import LiveTeacher
    from kdsweep.train.step import evaluate

    root, cells, results = matrix
    checked = 0
    # a teacher or a student base, read once per path (a teacher is only run; a base is copied for peft)
    model_at = functools.cache(AutoModelForCausalLM.from_pretrained)
    for key, record in results.items():
        if isinstance(record, str):
            continue
        row, mode, impl, ranks = key
        cfg = cells[key]
        rows = Rows.load(Path(record["data"]["cache_dir"]) / "eval.pt")
        batches = eval_batches_of_rank(rows, cfg.data.eval_batch_size, single_process(), torch.device("cpu"))
        teacher = model_at(cfg.teacher.path)
        loaded = {"merged": AutoModelForCausalLM.from_pretrained(record["exports"]["merged"])}
        if mode == "lora":
            loaded["adapter"] = PeftModel.from_pretrained(copy.deepcopy(model_at(cfg.model.path)),
                                                          record["exports"]["adapter"])
        else:
            assert "adapter" not in record["exports"]
        for name, model in loaded.items():
            ce = evaluate(model, LiveTeacher(teacher), batches, loss_cfg=LossConfig(), dist=single_process()).student_ce
            assert ce == pytest.approx(record["objective"], abs=1e-5), (key, name)
            checked += 1
    assert checked == 3 * (len(results) - 4) // 2


def test_lora_reaches_every_linear_layer_of_each_family(matrix):
    """``[all-linear, lm_head]``: peft's all-linear (whatever the family calls its projections) plus the output layer."""
    root, cells, _ = matrix
    expected = {
        "llama": "q_proj ×2, k_proj ×2, v_proj ×2, o_proj ×2, gate_proj ×2, up_proj ×2, down_proj ×2, lm_head",
        "phi3": "o_proj ×2, qkv_proj ×2, gate_up_proj ×2, down_proj ×2, lm_head",
        "gpt_neox": "query_key_value ×2, dense ×2, dense_h_to_4h ×2, dense_4h_to_h ×2, lm_head",
    }
    for arch, modules in expected.items():
        log = (Path(cells[(arch, "lora", "chunked", 1)].output_dir) / "kdsweep.log")
        text = log.read_text() if log.exists() else ""
        assert f"LoRA reached {modules.count('×2') * 2 + 1} modules (model.target_modules=all-linear,lm_head): {modules}" in text, text[-2000:]
