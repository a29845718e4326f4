"""kdsweep.rollout: the prompts of a micro-batch, generation, and the loss on generated tokens.

The loss on a completion is checked against a float64 reference written here from the divergences' definitions
(teacher t and student s softmaxed on the completion's positions only; the prompt counts nothing)."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import tiny_llama
from kdsweep.config.schema import LossConfig
from kdsweep.data.rows import Rows
from kdsweep.distributed import single_process
from kdsweep.losses import kd_loss_sums
from kdsweep.data.sampling import stream_seed
from kdsweep.rollout.generate import complete, sample
from kdsweep.rollout.prompts import completion_batch, prompts_of
from kdsweep.teacher.live import LiveTeacher
from kdsweep.train.step import micro_batch_backward

IGNORE, PAD, EOS = -100, 0, 2


def packed_row_batch():
    """One packed row of two samples (prompt 5 6 7 -> 8 9; prompt 10 11 -> 12) and one padded-style row of a chat
    whose two assistant turns are 21 and 24 25 (the last is what gets regenerated)."""
    row1 = [5, 6, 7, 8, 9, 10, 11, 12]
    lab1 = [IGNORE, IGNORE, 8, 9, IGNORE, IGNORE, 12, IGNORE]  # labels[t] is the target of input t
    pos1 = [0, 1, 2, 3, 4, 0, 1, 2]
    row2 = [20, 21, 22, 23, 24, 25, 0, 0]
    lab2 = [21, IGNORE, IGNORE, 24, 25, IGNORE, IGNORE, IGNORE]
    pos2 = [0, 1, 2, 3, 4, 5, 6, 7]
    rows = Rows.from_rows([row1, row2], [lab1, lab2], [pos1, pos2], [8, 6], pad_id=PAD, ignore_index=IGNORE)
    return rows.batch([0, 1])


def test_prompts_are_each_sample_up_to_its_last_labelled_span():
    prompts = prompts_of(packed_row_batch(), IGNORE, room=100)
    assert [p.ids for p in prompts] == [[5, 6, 7], [10, 11], [20, 21, 22, 23]]
    assert [p.key for p in prompts] == ["0.0", "0.1", "1.0"]
    assert [p.ids for p in prompts_of(packed_row_batch(), IGNORE, room=2)] == [[6, 7], [10, 11], [22, 23]]


def test_a_completion_batch_labels_the_completion_only():
    prompts = prompts_of(packed_row_batch(), IGNORE, room=100)
    batch = completion_batch(prompts, [[30, 31, EOS], [32], [33, 34]], pad_id=PAD, ignore_index=IGNORE, own_samples=True)
    assert batch.own_samples and batch.kd_weight(0.3) == 1.0
    assert batch.input_ids[0].tolist() == [5, 6, 7, 30, 31] and batch.labels[0].tolist() == [IGNORE, IGNORE, 30, 31, EOS]
    assert batch.labels[1].tolist()[:2] == [IGNORE, 32] and batch.attention_mask[1].tolist() == [1, 1, 0, 0, 0]
    assert int((batch.labels != IGNORE).sum()) == 3 + 1 + 2


def test_top_p_keeps_the_nucleus_only():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = {int(sample(logits, 1.0, 0.7, [torch.Generator().manual_seed(s)])[0]) for s in range(200)}
    assert draws == {0, 1}  # 0.5 + 0.3 holds 0.7; the rest is never drawn
    assert {int(sample(logits, 1.0, 1.0, [torch.Generator().manual_seed(s)])[0]) for s in range(400)} == {0, 1, 2, 3}


def test_a_prompt_s_completion_does_not_depend_on_its_batch_and_stops_at_eos():
    model = tiny_llama(vocab=40, max_positions=64)
    kw = dict(max_new_tokens=12, temperature=1.0, top_p=1.0, stop_ids={EOS}, pad_id=PAD, vocab=40,
              device=torch.device("cpu"), dist=single_process())
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20]]
    seeds = [stream_seed(0, 3, str(i)) for i in range(3)]
    together = complete(model, prompts, seeds, **kw)
    alone = [complete(model, [p], [s], **kw)[0] for p, s in zip(prompts, seeds)]
    assert together == alone and model.training  # left as it was found (train mode)
    assert all(len(c) == 12 or c[-1] == EOS for c in together)
    assert all(EOS not in c[:-1] for c in together)
    with torch.no_grad():  # greedy at a tiny temperature: the model's own argmax continuation, fed back in
        cold = complete(model, [prompts[0]], [1], **{**kw, "temperature": 1e-4, "stop_ids": set()})[0]
        seq = list(prompts[0])
        for _ in range(12):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert cold == seq[3:]


def test_compiled_decoder_layers_generate_eagerly_with_the_same_completions():
    """dist.compile compiles each decoder layer; generation must not recompile them for every new length, and must
    complete as the plain model does."""
    from kdsweep.distributed.fsdp import decoder_layers

    plain, compiled = tiny_llama(vocab=40, seed=3), tiny_llama(vocab=40, seed=3)
    for layer in decoder_layers(compiled):
        layer.compile()
    kw = dict(max_new_tokens=8, temperature=1.0, top_p=1.0, stop_ids={EOS}, pad_id=PAD, vocab=40,
              device=torch.device("cpu"), dist=single_process())
    prompts, seeds = [[5, 6, 7], [9, 10]], [11, 12]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert complete(compiled, prompts, seeds, **kw) == complete(plain, prompts, seeds, **kw)
    assert not torch._dynamo.utils.counters["frames"]  # no layer was compiled (nor recompiled) while generating


@pytest.mark.parametrize("divergence,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3), ("jsd", 0.5)])
def test_the_loss_on_generated_tokens_equals_a_float64_reference(divergence, beta):
    student, teacher = tiny_llama(vocab=40, seed=1), tiny_llama(vocab=40, hidden=48, seed=2).eval()
    prompts = prompts_of(packed_row_batch(), IGNORE, room=100)
    kw = dict(max_new_tokens=6, temperature=1.0, top_p=0.9, stop_ids={EOS}, pad_id=PAD, vocab=40,
              device=torch.device("cpu"), dist=single_process())
    completions = complete(student, [p.ids for p in prompts], [7, 8, 9], **kw)
    batch = completion_batch(prompts, completions, pad_id=PAD, ignore_index=IGNORE, own_samples=True)
    cfg = LossConfig(kd_ratio=0.4, divergence=divergence, beta=beta)
    with LiveTeacher(teacher).targets(batch) as targets:
        sums = micro_batch_backward(student, targets, batch, cfg, torch.tensor(1.0))

    ref, n = 0.0, 0
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            seq = torch.tensor([p.ids + c])
            s = torch.log_softmax(student(seq).logits[0].double(), -1)
            t = torch.log_softmax(teacher(seq).logits[0].double(), -1)
            for pos in range(len(p.ids) - 1, len(p.ids) + len(c) - 1):  # the positions that predict the completion
                ps, pt = s[pos].exp(), t[pos].exp()
                if divergence == "forward_kl":
                    d = (pt * (t[pos] - s[pos])).sum()
                elif divergence == "reverse_kl":
                    d = (ps * (s[pos] - t[pos])).sum()
                else:
                    m = beta * pt + (1 - beta) * ps
                    d = beta * (pt * (pt.log() - m.log())).sum() + (1 - beta) * (ps * (ps.log() - m.log())).sum()
                ref, n = ref + float(d), n + 1
    assert int(sums.tokens) == n == sum(len(c) for c in completions)
    assert math.isclose(float(sums.kd), ref, rel_tol=1e-5, abs_tol=1e-6)
    # own samples: the KD term alone is differentiated (kd_ratio counts as 1)
    grads = [q.grad for q in student.parameters() if q.grad is not None]
    student.zero_grad()
    with LiveTeacher(teacher).targets(batch) as targets:
        kd_loss_sums(student(**batch.inputs()).logits, targets, batch.labels, divergence=divergence, beta=beta).kd.backward()
    again = [q.grad for q in student.parameters() if q.grad is not None]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, again))
