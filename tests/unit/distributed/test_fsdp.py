"""Two gloo ranks: every architecture's models built sharded, each rank reading its own rows, with every buffer and
the logits of a whole load (each placement's tensors to the bit: tests/unit/models/test_shards.py)."""

import os

import torch

from helpers import gloo_ranks, word_tokenizer
from kdsweep.config import DistConfig, StudentConfig
from kdsweep.distributed import detect
from kdsweep.models.load import load_student, load_teacher


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
    """Each model is created empty on every rank, which reads its own rows: buffers no state dict holds (rotary
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
