"""Each rank reads its own rows of a model from the files: the same tensors as one process's whole load, every
placement, every tensor (LoRA's random A included), and only the rows it keeps; gathered on rank 0 for export, the
same again. (Every architecture's buffers and logits against a whole load: tests/unit/distributed/test_fsdp.py.)"""

import logging
import os

import pytest
import torch

from helpers import gloo_ranks, save_arch, word_tokenizer
from kdsweep.config import DistConfig, StudentConfig
from kdsweep.distributed.placement import forget_meshes
from kdsweep.models import shards
from kdsweep.models.load import load_student, load_teacher, read_model, student_wrapper, unsharded_on_rank0


def _whole(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` whole (a collective for a sharded one)."""
    from torch.distributed.tensor import DTensor

    named = [*model.named_parameters(), *model.named_buffers()]
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for n, t in named}


def _rank(rank: int, root: str) -> None:
    from torch.distributed.tensor import DTensor

    from kdsweep.distributed import detect

    env, cpu, out = detect(), torch.device("cpu"), {}
    for arch in ("llama", "qwen2"):
        model_dir = os.path.join(root, arch)
        lora = StudentConfig(path=model_dir, lora_rank=4, target_modules=("all-linear",))
        full = StudentConfig(path=model_dir, lora_rank=0)
        built = {
            "lora_fsdp": load_student(model_dir, lora, "fp32", cpu, 7, env, DistConfig()),
            "full_hsdp": load_student(model_dir, full, "fp32", cpu, 7, env, DistConfig(student_mesh="hsdp")),
            "teacher_world": load_teacher(model_dir, "fp32", cpu, env, DistConfig(teacher_placement="world")),
            "teacher_node": load_teacher(model_dir, "fp32", cpu, env, DistConfig(teacher_placement="node")),
            "teacher_replicate": load_teacher(model_dir, "fp32", cpu, env, DistConfig(teacher_placement="replicate")),
        }
        for how, model in built.items():
            for name, p in model.named_parameters():  # this rank's rows only: a quarter (world) or a half (node)
                if isinstance(p, DTensor):
                    over = 4 if how in ("lora_fsdp", "teacher_world") else 2  # a node's 2 ranks: a 2-D mesh
                    assert p.device_mesh.ndim == (1 if over == 4 else 2), (how, name)
                    assert p.to_local().shape[0] <= -(-p.shape[0] // over), (how, name)
                else:
                    assert how == "teacher_replicate", (how, name)
            assert how.startswith("teacher") != any(p.requires_grad for p in model.parameters()), how
            out[f"{arch}/{how}"] = _whole(model)
        gathered = unsharded_on_rank0(built["lora_fsdp"], model_dir, lora, "fp32", 7, env)  # for export
        assert (gathered is None) == (rank != 0)
        if gathered is not None:
            out[f"{arch}/lora_fsdp gathered"] = {n: t.clone() for n, t in gathered.state_dict().items()}
    if rank == 0:
        torch.save(out, os.path.join(root, "loaded.pt"))
    forget_meshes()


def test_four_ranks_on_two_nodes_load_every_tensor_of_a_whole_load(tmp_path, monkeypatch):
    tok = word_tokenizer()
    for arch in ("llama", "qwen2"):  # untied, and tied embeddings (one tensor in the files for two names)
        save_arch(tmp_path / arch, arch, tok)
    monkeypatch.setenv("KDSWEEP_LOCAL_RANKS", "1")  # ranks as kdsweep's launcher starts them, on nodes of 2
    monkeypatch.setenv("KDSWEEP_TEST_RANKS_PER_NODE", "2")  # ranks 0-1 and 2-3
    gloo_ranks(_rank, str(tmp_path), tmp_path=tmp_path, nprocs=4)
    got = torch.load(tmp_path / "loaded.pt")
    for arch in ("llama", "qwen2"):
        model_dir = tmp_path / arch
        lora = StudentConfig(path=str(model_dir), lora_rank=4, target_modules=("all-linear",))
        plain = load_student(model_dir, lora, "fp32", torch.device("cpu"), 7)
        expected = {
            "lora_fsdp": _whole(plain),
            "lora_fsdp gathered": plain.state_dict(),  # (a tied pair under both its names)
            "full_hsdp": _whole(load_student(model_dir, StudentConfig(path=str(model_dir), lora_rank=0), "fp32",
                                              torch.device("cpu"), 7)),
            "teacher": _whole(load_teacher(model_dir, "fp32", torch.device("cpu"))),
        }
        assert any("lora_A" in n for n in expected["lora_fsdp"])
        checked = set()
        for how, tensors in expected.items():
            same = [k for k in got if k.startswith(f"{arch}/{how}") and ("gathered" in k) == ("gathered" in how)]
            checked.update(same)
            for placed in same:
                assert sorted(got[placed]) == sorted(tensors), placed
                for name, t in tensors.items():  # to the bit: the same bytes, read by rows
                    assert torch.equal(got[placed][name], t), (placed, name)
        assert checked == {k for k in got if k.startswith(f"{arch}/")} and len(checked) == 6, checked


def test_a_checkpoint_in_several_files_is_read_file_by_file_into_the_same_tensors(tmp_path):
    model_dir = save_arch(tmp_path / "m", "llama", word_tokenizer())
    read_model(model_dir, torch.float32).save_pretrained(tmp_path / "split", max_shard_size="20KB")
    assert len(list((tmp_path / "split").glob("model-*.safetensors"))) > 2
    model, kept = shards.empty(tmp_path / "split", torch.bfloat16, lambda m: m.eval())
    rows = shards.rows_of(tmp_path / "split", model, torch.bfloat16)
    assert isinstance(rows, shards.SafetensorsRows)
    shards.materialise(model, torch.device("cpu"))
    shards.fill(model, rows, kept)
    expected = read_model(model_dir, torch.bfloat16).state_dict()
    assert sorted(model.state_dict()) == sorted(expected)
    for name, t in expected.items():
        assert model.state_dict()[name].dtype == torch.bfloat16 and torch.equal(model.state_dict()[name], t), name


def test_a_checkpoint_transformers_must_convert_is_read_whole_and_said(tmp_path, caplog):
    """A Mixtral's experts are separate tensors in its files and one fused tensor in transformers 5's model: more
    than a renaming, so every rank reads the model whole and keeps its rows (the same tensors), and the log says why."""
    import transformers as tf

    cfg = tf.MixtralConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1,
                           tie_word_embeddings=False)
    torch.manual_seed(0)
    tf.MixtralForCausalLM(cfg).save_pretrained(tmp_path / "moe")
    wrap = student_wrapper(StudentConfig(path=str(tmp_path / "moe"), lora_rank=2, target_modules=("q_proj", "v_proj")),
                           seed=3)
    model, kept = shards.empty(tmp_path / "moe", torch.float32, wrap)
    with caplog.at_level(logging.WARNING, logger="kdsweep.models.shards"):
        rows = shards.rows_of(tmp_path / "moe", model, torch.float32)
    assert isinstance(rows, shards.ModelRows)
    assert "every rank reads" in caplog.text and "conversion" in caplog.text
    shards.materialise(model, torch.device("cpu"))
    shards.fill(model, rows, kept)
    expected = wrap(read_model(tmp_path / "moe", torch.float32)).state_dict()
    assert sorted(model.state_dict()) == sorted(expected)
    for name, t in expected.items():
        assert torch.equal(model.state_dict()[name], t), name


def test_a_weight_the_files_lack_is_one_line_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = save_arch(tmp_path / "m", "llama", word_tokenizer())
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    model, kept = shards.empty(model_dir, torch.float32, lambda m: m.eval())
    shards.materialise(model, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^model\.norm\.weight is in no safetensors file"):
        shards.fill(model, shards.rows_of(model_dir, model, torch.float32), kept)
