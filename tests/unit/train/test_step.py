"""train_step: gradients are those of the global token-mean loss, however the step's batch is split."""

import copy
import math

import pytest
import torch

from helpers import chunk_mb_for, tiny_llama
from kdsweep.config import LossConfig
from kdsweep.data.batch import Batch
from kdsweep.distributed import single_process
from kdsweep.losses import kd_loss_sums
from kdsweep.teacher.live import LiveTeacher
from kdsweep.train.step import Learner, train_step

IGNORE = -100
B, T, V = 8, 12, 96


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    # Ragged: sequence i keeps only its first 2 + i labels, so micro-batches hold very different token counts.
    for i in range(B):
        y[i, 2 + i:] = IGNORE
    y[3] = IGNORE  # one sequence with no valid token at all
    return x, y


def student_and_teacher(lora: bool):
    student = tiny_llama(seed=1)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(2)
        student = get_peft_model(student, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
        # LoRA B starts at zero, which would hide errors in A's gradient: give B a value.
        for n, p in student.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1)
    teacher = tiny_llama(seed=3).eval().requires_grad_(False)
    return student.train(), teacher


def run_split(student, teacher, micro: int, loss_cfg):
    student = copy.deepcopy(student)
    params = [p for p in student.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    x, y = batch()
    micro_batches = [Batch(a, b) for a, b in zip(x.split(micro), y.split(micro))]
    learner = Learner(student, LiveTeacher(teacher, fused=loss_cfg.impl == "fused"), opt, sched, loss_cfg, 0.0)
    stats, = train_step([learner], micro_batches, dist=single_process())
    grads = [b - p.detach() for b, p in zip(before, params)]  # SGD with lr 1: the update is the gradient
    return grads, stats


ONE_CHUNK = LossConfig().chunk_mb
SPLIT = chunk_mb_for(3, T, V)  # a one-row micro-batch in 3 chunks, the whole batch in 24


@pytest.mark.parametrize("lora", [True, False])
@pytest.mark.parametrize("impl, chunk_mb", [("chunked", ONE_CHUNK), ("chunked", SPLIT), ("fused", SPLIT)])
def test_gradients_identical_for_1x8_2x4_8x1(lora, impl, chunk_mb):
    """The plain graph (one chunk) and the chunk paths (3 chunks or more) alike."""
    student, teacher = student_and_teacher(lora)
    loss_cfg = LossConfig(kd_ratio=0.4, temperature=2.0, impl=impl, chunk_mb=chunk_mb)
    results = {m: run_split(student, teacher, m, loss_cfg) for m in (8, 4, 1)}
    g8, s8 = results[8]
    for m in (4, 1):
        g, s = results[m]
        for a, b in zip(g8, g):
            assert torch.allclose(a, b, rtol=0, atol=1e-6), (m, (a - b).abs().max())
        assert s.loss == pytest.approx(s8.loss, rel=1e-6) and s.tokens == s8.tokens

    # ... and they are the gradients of the token-mean loss of the whole batch in one pass.
    ref_student = copy.deepcopy(student)
    x, y = batch()
    sums = kd_loss_sums(ref_student(input_ids=x).logits, teacher(input_ids=x).logits, y, temperature=2.0)
    (sums.total(0.4) / sums.tokens).backward()
    ref = [p.grad for p in ref_student.parameters() if p.requires_grad]
    for a, b in zip(g8, ref):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_logged_losses_are_token_weighted_means_of_the_whole_step():
    student, teacher = student_and_teacher(lora=True)
    loss_cfg = LossConfig(kd_ratio=0.5, temperature=1.0)
    _, stats = run_split(student, teacher, 2, loss_cfg)
    x, y = batch()
    with torch.no_grad():
        sums = kd_loss_sums(student(input_ids=x).logits, teacher(input_ids=x).logits, y, temperature=1.0)
    n = sums.tokens.item()
    assert stats.tokens == n == int((y != IGNORE).sum())
    assert stats.ce == pytest.approx(sums.ce.item() / n, rel=1e-5)
    assert stats.kd == pytest.approx(sums.kd.item() / n, rel=1e-5)
    assert stats.loss == pytest.approx(0.5 * stats.ce + 0.5 * stats.kd, rel=1e-6)


def test_gradient_clipping_bounds_the_update():
    student, teacher = student_and_teacher(lora=False)
    params = [p for p in student.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    x, y = batch()
    learner = Learner(student, LiveTeacher(teacher), opt, sched, LossConfig(kd_ratio=0.5), max_grad_norm=1e-3)
    stats, = train_step([learner], [Batch(x, y)], dist=single_process())
    update_norm = torch.sqrt(sum(((b - p.detach()) ** 2).sum() for b, p in zip(before, params)))
    assert stats.grad_norm > 1e-3  # the unclipped norm is reported
    assert update_norm.item() == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize("impl", ["chunked", "fused"])
def test_kd_ratio_0_trains_without_the_teacher_exactly_as_with_it(impl):
    """kd_ratio=0's training source gives no targets: the teacher never runs, and the step equals the one that ran
    it and weighed it 0, bit for bit (the student's 8 padded output rows cut to the teacher's 96, as its targets
    cut them); the logged KL is not measured."""
    from kdsweep.teacher.absent import TeacherFree

    from peft import LoraConfig, get_peft_model

    student = get_peft_model(tiny_llama(vocab=V + 8, seed=1), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    for n, p in student.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    teacher = tiny_llama(seed=3).eval().requires_grad_(False)
    calls = []
    teacher.register_forward_pre_hook(lambda *a: calls.append(1))
    loss_cfg = LossConfig(kd_ratio=0.0, chunk_mb=chunk_mb_for(3, 4 * T, V), impl=impl)
    x, y = batch()
    results = {}
    for name, source in (("live", LiveTeacher(teacher, fused=impl == "fused")), ("free", TeacherFree(V))):
        s = copy.deepcopy(student)
        params = [p for p in s.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        calls.clear()
        stats, = train_step([Learner(s, source, opt, sched, loss_cfg, max_grad_norm=0.0)],
                            [Batch(a, b) for a, b in zip(x.split(4), y.split(4))], dist=single_process())
        results[name] = (stats, [p.detach().clone() for p in params], len(calls))
    (live, w_live, ran), (free, w_free, ran_free) = results["live"], results["free"]
    assert ran == 2 and ran_free == 0 and source.tokens_computed == source.tokens_read == 0
    assert all(torch.equal(a, b) for a, b in zip(w_live, w_free))
    assert free.ce == live.ce and free.loss == live.loss == live.ce and free.grad_norm == live.grad_norm
    assert free.kd == 0.0 and live.kd > 0 and math.isnan(free.kl) and live.kl > 0


def test_an_evaluation_keeps_no_chunk_s_teacher_logits_once_the_chunk_is_scored():
    """A fused evaluation projects the teacher's hidden states one chunk at a time, and each chunk's logits are gone
    before the next chunk's are made. They used to stay on the chunk (for its teacher CE), and the batch's list of
    chunks kept every one: the batch's whole [N, V] (2 GB more than a training step at 128k, 2,048 tokens)."""
    import weakref
    from contextlib import contextmanager

    from kdsweep.train.step import evaluate

    student, teacher = student_and_teacher(lora=False)
    alive_at_each_projection = []

    class Tracking(LiveTeacher):
        @contextmanager
        def targets(self, batch):
            with super().targets(batch) as targets:
                made, head = [], targets.head

                def projected(hidden):
                    alive_at_each_projection.append(sum(ref() is not None for ref in made))
                    out = head(hidden)
                    made.append(weakref.ref(out))
                    return out

                targets.head = projected
                yield targets

    x, y = batch()
    cfg = LossConfig(impl="fused", chunk_mb=chunk_mb_for(6, B * T, V))
    result = evaluate(student, Tracking(teacher, fused=True), [Batch(x, y)], loss_cfg=cfg, dist=single_process(),
                      chunks=6)
    assert len(alive_at_each_projection) >= 6 and max(alive_at_each_projection) == 0
    assert math.isfinite(result.teacher_ce) and result.teacher_ce > 0
