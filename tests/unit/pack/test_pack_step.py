"""A pack's step: several learners over one frozen student base and one teacher pass, each exactly the trial it
would be alone (kdsweep.pack, train_step over several Learners)."""

import math

import pytest
import torch

from helpers import chunk_mb_for, save_hf_model, tiny_llama, word_tokenizer
from kdsweep.config import LossConfig
from kdsweep.config.schema import StudentConfig
from kdsweep.data.batch import Batch
from kdsweep.distributed import single_process
from kdsweep.models.load import load_student
from kdsweep.pack import shares_base, students_over_one_base
from kdsweep.teacher.absent import TeacherFree
from kdsweep.teacher.live import LiveTeacher
from kdsweep.train.step import EvalAsk, Learner, evaluate, evaluate_together, train_step

IGNORE = -100
SEED = 7
# Per-member knobs: LoRA rank and alpha, learning rate, kd_ratio, divergence, temperature, β, clipping.
MEMBERS = [
    dict(rank=4, alpha=8.0, lr=3e-2, loss=dict(kd_ratio=0.0), clip=1.0),
    dict(rank=8, alpha=16.0, lr=1e-2, loss=dict(kd_ratio=0.5, divergence="forward_kl", temperature=2.0), clip=0.0),
    dict(rank=16, alpha=16.0, lr=3e-2, loss=dict(kd_ratio=1.0, divergence="jsd", beta=0.3), clip=0.5),
    dict(rank=8, alpha=32.0, lr=1e-2, loss=dict(kd_ratio=0.5, divergence="jsd", beta=0.5, temperature=1.5), clip=1.0),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pack")
    tok = word_tokenizer()
    student_dir = save_hf_model(root / "student", tok, seed=1)
    teacher = tiny_llama(vocab=len(tok), seed=3).eval().requires_grad_(False)
    return student_dir, teacher, len(tok)


def batches(vocab: int, steps: int, micro: int = 2):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        x, y = (torch.randint(0, vocab, (2 * micro, 12), generator=g) for _ in range(2))
        y[0, 7:] = IGNORE  # ragged: not every row counts every token
        out.append([Batch(a, b) for a, b in zip(x.split(2), y.split(2))])
    return out


def student_cfg(m) -> StudentConfig:
    return StudentConfig(path="student", lora_rank=m["rank"], lora_alpha=m["alpha"],
                         target_modules=("q_proj", "v_proj", "lm_head"))


def learner(student, teacher_source, m, impl, chunk_mb, vocab) -> Learner:
    loss_cfg = LossConfig(**m["loss"], impl=impl, chunk_mb=chunk_mb)
    source = teacher_source if loss_cfg.kd_ratio else TeacherFree(vocab)  # kd_ratio=0: as kdsweep's for_training
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=m["lr"], weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return Learner(student, source, opt, sched, loss_cfg, m["clip"])


def adapter(student) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in student.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("impl, chunks", [("chunked", 1), ("chunked", 3), ("fused", 3)])
def test_each_member_of_a_pack_steps_exactly_as_its_trial_alone_and_the_teacher_runs_once(models, impl, chunks):
    student_dir, teacher, vocab = models
    steps = batches(vocab, steps=3)
    chunk_mb = chunk_mb_for(chunks, 2 * 12, vocab)
    calls = []
    hook = teacher.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        alone = []
        for m in MEMBERS:  # each trial as it runs today: its own student, its own teacher forward
            s = load_student(student_dir, student_cfg(m), "fp32", torch.device("cpu"), SEED)
            one = learner(s, LiveTeacher(teacher, fused=impl == "fused"), m, impl, chunk_mb, vocab)
            alone.append(([train_step([one], micro, dist=single_process())[0] for micro in steps], adapter(s)))
        calls.clear()
        students = students_over_one_base(student_dir, [student_cfg(m) for m in MEMBERS], "fp32",
                                          torch.device("cpu"), SEED)
        shared = LiveTeacher(teacher, fused=impl == "fused")
        pack = [learner(s, shared, m, impl, chunk_mb, vocab) for s, m in zip(students, MEMBERS)]
        packed = [train_step(pack, micro, dist=single_process()) for micro in steps]
    finally:
        hook.remove()
    assert len(calls) == sum(len(micro) for micro in steps)  # one teacher forward per micro-batch, not per member
    fresh = load_student(student_dir, student_cfg(MEMBERS[0]), "fp32", torch.device("cpu"), SEED)
    assert shares_base(students) and not shares_base([students[0], fresh])
    # the same arithmetic in the same order as alone: the same bits (one process, one thread)
    for k, (rows, weights) in enumerate(alone):
        for step, solo in enumerate(rows):
            got = packed[step][k]
            for field in ("loss", "ce", "kd", "grad_norm", "lr"):
                assert getattr(got, field) == getattr(solo, field), (k, step, field)
            assert got.tokens == solo.tokens
            assert (math.isnan(got.kl) and math.isnan(solo.kl)) if MEMBERS[k]["loss"]["kd_ratio"] == 0 else \
                got.kl == solo.kl
        mine = adapter(students[k])
        assert mine.keys() == weights.keys() and len(mine) == 2 * 2 * 2 + 2  # A and B: q and v of 2 layers, lm_head
        for name, w in weights.items():
            assert torch.equal(mine[name], w), (k, name)
    assert {tuple(p.shape) for p in students[2].parameters() if p.requires_grad} != \
        {tuple(p.shape) for p in students[0].parameters() if p.requires_grad}  # ranks differ


@pytest.mark.parametrize("impl, chunks", [("chunked", 1), ("chunked", 3), ("fused", 3)])
def test_members_evaluated_together_score_as_each_alone_and_the_teacher_runs_once_per_batch(models, impl, chunks):
    """A pack's evaluation (evaluate_together): each held-out batch's targets made once for every member, and each
    member's numbers the same bits as its evaluation alone."""
    student_dir, teacher, vocab = models
    chunk_mb = chunk_mb_for(chunks, 2 * 12, vocab)
    students = students_over_one_base(student_dir, [student_cfg(m) for m in MEMBERS], "fp32", torch.device("cpu"),
                                      SEED)
    shared = LiveTeacher(teacher, fused=impl == "fused")
    pack = [learner(s, shared, m, impl, chunk_mb, vocab) for s, m in zip(students, MEMBERS)]
    train_step(pack, batches(vocab, 1)[0], dist=single_process())  # the adapters apart (B = 0 scores as the base)
    held = batches(vocab, 2)[1]
    calls = []
    hook = teacher.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        together = evaluate_together([EvalAsk(lr.student, shared, held, lr.loss_cfg) for lr in pack],
                                     dist=single_process())
        counted = len(calls)
        alone = [evaluate(lr.student, LiveTeacher(teacher, fused=impl == "fused"), held, loss_cfg=lr.loss_cfg,
                          dist=single_process()) for lr in pack]
    finally:
        hook.remove()
    assert counted == len(held) and len(calls) == (1 + len(pack)) * len(held)
    assert together == alone and len({r.student_ce for r in together}) == len(pack)
    assert all(s.training for s in students)  # left in train mode, as evaluate leaves its student


def test_a_members_adapter_is_the_one_its_trial_would_start_from_and_the_base_is_held_once(models):
    student_dir, _, _ = models
    cfgs = [student_cfg(m) for m in MEMBERS]
    students = students_over_one_base(student_dir, cfgs, "fp32", torch.device("cpu"), SEED)
    for cfg, s in zip(cfgs, students):
        solo = load_student(student_dir, cfg, "fp32", torch.device("cpu"), SEED)
        assert adapter(s).keys() == adapter(solo).keys()
        assert all(torch.equal(a, b) for a, b in zip(adapter(s).values(), adapter(solo).values()))
        frozen = {n: p for n, p in s.named_parameters() if not p.requires_grad}
        assert all(torch.equal(p, dict(solo.named_parameters())[n]) for n, p in frozen.items())
    assert shares_base(students)
    held = {p.data_ptr(): p.numel() for s in students for p in s.parameters()}
    base = sum(p.numel() for p in students[0].parameters() if not p.requires_grad)
    own = sum(p.numel() for s in students for p in s.parameters() if p.requires_grad)
    assert sum(held.values()) == base + own  # the base's weights once, each adapter its own


def test_a_full_fine_tune_cannot_share_the_base_and_says_so_in_one_line(models):
    student_dir, _, _ = models
    with pytest.raises(ValueError) as e:
        cfgs = [student_cfg(MEMBERS[0]), StudentConfig(path="student", lora_rank=0)]
        students_over_one_base(student_dir, cfgs, "fp32", torch.device("cpu"), SEED)
    assert "\n" not in str(e.value) and "member 1 has lora_rank=0" in str(e.value) and "run it unpacked" in str(e.value)


def test_learners_that_count_tokens_differently_are_refused(models):
    student_dir, teacher, vocab = models
    s1, s2 = students_over_one_base(student_dir, [student_cfg(MEMBERS[1])] * 2, "fp32", torch.device("cpu"), SEED)
    a = learner(s1, LiveTeacher(teacher), MEMBERS[1], "chunked", 128.0, vocab)
    b = learner(s2, LiveTeacher(teacher), MEMBERS[1], "chunked", 128.0, vocab)
    b.loss_cfg = LossConfig(ignore_index=-1)
    with pytest.raises(ValueError, match="loss.ignore_index differs"):
        train_step([a, b], batches(vocab, 1)[0], dist=single_process())
