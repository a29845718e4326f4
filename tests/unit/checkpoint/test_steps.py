"""Step checkpoints: exact round trip of trainable state, atomic publication, pruning."""

import torch

from helpers import tiny_llama
from kdsweep.checkpoint import steps
from kdsweep.distributed import single_process


def lora_model_and_optimizer():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(seed=0), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def train_a_step(model, opt):
    x = torch.randint(0, 96, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()


def test_round_trip_restores_params_optimizer_and_rng(tmp_path):
    model, opt = lora_model_and_optimizer()
    train_a_step(model, opt)
    saved = steps.save(tmp_path, 1, model, opt, {"step": 1, "note": "x"}, single_process(), keep_last=2)
    expected_next = torch.rand(3)  # the RNG stream right after the save

    fresh, fresh_opt = lora_model_and_optimizer()
    state = steps.load(saved, fresh, fresh_opt, single_process())
    assert state == {"step": 1, "note": "x"}
    assert torch.equal(torch.rand(3), expected_next)
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), n
    torch.manual_seed(5)
    train_a_step(model, opt)
    torch.manual_seed(5)
    train_a_step(fresh, fresh_opt)
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), n  # Adam moments came back too, else this step would differ


def test_only_trainable_parameters_are_saved(tmp_path):
    model, opt = lora_model_and_optimizer()
    train_a_step(model, opt)
    saved = steps.save(tmp_path, 1, model, opt, {}, single_process(), keep_last=1)
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(saved).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)


def test_incomplete_checkpoints_are_ignored_and_old_ones_pruned(tmp_path):
    model, opt = lora_model_and_optimizer()
    for step in (2, 4, 6):
        steps.save(tmp_path, step, model, opt, {"step": step}, single_process(), keep_last=2)
    (tmp_path / ".tmp-step_00000008").mkdir()  # what a kill during a save leaves behind
    assert steps.latest(tmp_path).name == "step_00000006"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-step_00000008", "step_00000004", "step_00000006"]
    steps.save(tmp_path, 8, model, opt, {"step": 8}, single_process(), keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000006", "step_00000008"]
    assert steps.latest(tmp_path / "missing") is None
