"""Two gloo ranks: models are really sharded, loaded from rank 0, rotary buffers rebuilt, logits unchanged."""

import os

import torch

from helpers import gloo_ranks, save_hf_model, word_tokenizer
from kdsweep.config import DistConfig, StudentConfig
from kdsweep.distributed import detect
from kdsweep.models.load import load_student, load_teacher, unsharded_on_rank0


def _rank(rank: int, model_dir: str, out_dir: str) -> None:
    env = detect()
    cfg = StudentConfig(path=model_dir, lora_rank=4, target_modules=("q_proj", "v_proj"))
    student = load_student(model_dir, cfg, "fp32", torch.device("cpu"), seed=0, env=env, dist_cfg=DistConfig())
    teacher = load_teacher(model_dir, "fp32", torch.device("cpu"), env, DistConfig(teacher_placement="world"))
    replica = load_teacher(model_dir, "fp32", torch.device("cpu"), env, DistConfig(teacher_placement="replicate"))
    from torch.distributed.tensor import DTensor

    for name, p in list(student.named_parameters()) + list(teacher.named_parameters()):
        assert isinstance(p, DTensor), name
        assert p.to_local().numel() <= (p.numel() + 1) // 2 + p.shape[-1], name  # a half, not a copy
    assert not any(p.requires_grad for p in teacher.parameters())
    assert not any(isinstance(p, DTensor) or p.requires_grad for p in replica.parameters())  # a whole frozen copy
    x = torch.arange(12).reshape(2, 6) % 20
    with torch.no_grad():  # the replicated teacher is the sharded one, to every digit
        assert torch.equal(replica(input_ids=x).logits, teacher(input_ids=x).logits)
    with torch.no_grad():
        logits = student(input_ids=x).logits
    for m in student.modules():
        if hasattr(m, "inv_freq"):
            fresh = type(m)(m.config)
            assert torch.equal(m.inv_freq, fresh.inv_freq)
    full = unsharded_on_rank0(student, model_dir, cfg, "fp32", 0, env)
    if rank == 0:
        with torch.no_grad():
            torch.save({"sharded": logits, "gathered": full(input_ids=x).logits}, os.path.join(out_dir, "logits.pt"))
    else:
        assert full is None


def test_sharded_build_matches_a_plain_model(tmp_path):
    model_dir = save_hf_model(tmp_path / "m", word_tokenizer(), hidden=32, layers=2)
    gloo_ranks(_rank, str(model_dir), str(tmp_path), tmp_path=tmp_path)
    got = torch.load(tmp_path / "logits.pt")
    cfg = StudentConfig(path=str(model_dir), lora_rank=4, target_modules=("q_proj", "v_proj"))
    plain = load_student(model_dir, cfg, "fp32", torch.device("cpu"), seed=0)
    x = torch.arange(12).reshape(2, 6) % 20
    with torch.no_grad():
        ref = plain(input_ids=x).logits
    assert torch.allclose(got["sharded"], ref, atol=1e-5)
    assert torch.allclose(got["gathered"], ref, atol=1e-5)


def _rank_archs(rank: int, root: str) -> None:
    from helpers import ARCHS

    env = detect()
    x = torch.arange(24).reshape(2, 12) % 18 + 4
    for arch in ARCHS:
        model_dir = os.path.join(root, arch)
        cfg = StudentConfig(path=model_dir, lora_rank=4, target_modules=("all-linear", "lm_head"))
        built = {"teacher": load_teacher(model_dir, "fp32", torch.device("cpu"), env, DistConfig()),
                 "student": load_student(model_dir, cfg, "fp32", torch.device("cpu"), 0, env, DistConfig())}
        for role, model in built.items():
            with torch.no_grad():
                logits = model(input_ids=x).logits
            if rank == 0:
                buffers = {name: b.clone() for name, b in model.named_buffers()}
                torch.save({"buffers": buffers, "logits": logits}, os.path.join(root, f"{arch}-{role}.pt"))


def test_every_architecture_builds_sharded_with_every_buffer_of_a_plain_load(tmp_path):
    """Each model is created empty on every rank and filled from rank 0: buffers no state dict holds (rotary
    frequencies, Gemma's embed_scale and its local/global rotary pairs) must come out as from_pretrained's."""
    from helpers import ARCHS, save_arch
    from transformers import AutoModelForCausalLM

    tok = word_tokenizer()
    for arch in ARCHS:
        save_arch(tmp_path / arch, arch, tok)
    gloo_ranks(_rank_archs, str(tmp_path), tmp_path=tmp_path)
    x = torch.arange(24).reshape(2, 12) % 18 + 4
    for arch in ARCHS:
        cfg = StudentConfig(path=str(tmp_path / arch), lora_rank=4, target_modules=("all-linear", "lm_head"))
        plain = {"teacher": AutoModelForCausalLM.from_pretrained(tmp_path / arch),
                 "student": load_student(tmp_path / arch, cfg, "fp32", torch.device("cpu"), seed=0)}
        for role, model in plain.items():
            got = torch.load(tmp_path / f"{arch}-{role}.pt")
            expected = dict(model.named_buffers())
            assert sorted(got["buffers"]) == sorted(expected) and expected, (arch, role)
            for name, buf in expected.items():
                assert torch.equal(got["buffers"][name], buf), (arch, role, name)
            with torch.no_grad():
                assert torch.allclose(got["logits"], model(input_ids=x).logits, atol=1e-5), (arch, role)
