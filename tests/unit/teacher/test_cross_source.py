"""The live cross-tokenizer teacher (kdsweep.teacher.cross.CrossTokenizerTeacher) on tiny random Llama teachers and
real tokenizers of two conventions: with the student's own tokenizer and model it gives the live teacher's loss
exactly (packed and padded rows); with another tokenizer it reads the same text, and trains only what aligns."""

from __future__ import annotations

import pytest
import torch

from helpers import one_thread  # noqa: F401
from kdsweep.data.batch import Batch
from kdsweep.data.rows import Rows
from kdsweep.teacher.aligned_rows import AlignedRows
from kdsweep.losses import DIVERGENCES, kd_loss_sums
from kdsweep.teacher.cross import CrossTokenizerTeacher, vocab_map_of
from kdsweep.teacher.live import LiveTeacher
from kdsweep.teacher.align import align_spans
from kdsweep.teacher.reader import RowReader, is_byte_level
from test_align import TEXTS, tokenizer

IGNORE = -100


def tiny_model(vocab: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128, use_cache=False)
    return LlamaForCausalLM(config).eval()


def student_rows(kind: str, packed: bool, T: int = 100) -> Rows:
    """Two rows as kdsweep's data makes them. Packed: each document its own positions (from 0), its last token's
    target the EOS, which is no input. Not packed (a stream): BOS, documents joined by EOS inputs, every target the
    next token. A row cut at ``T`` (40 cuts row 0 inside a word) keeps the target past its end; then padding, never
    a target; row 1's first two targets are not trained."""
    tok = tokenizer(kind)
    rows, positions, targets = [], [], []
    for docs in ((TEXTS[0], TEXTS[2]), (TEXTS[1], TEXTS[3])):
        ids, pos, tgt = [], [], []  # the whole row before the cut: inputs, positions, each input's target
        if not packed:
            ids, pos = [tok.bos_token_id], [0]
        for d in docs:
            doc = tok(d, add_special_tokens=False)["input_ids"]
            if packed:
                ids, pos, tgt = ids + doc, pos + list(range(len(doc))), tgt + doc[1:] + [tok.eos_token_id]
            else:
                ids += doc + [tok.eos_token_id]
        if not packed:
            pos, tgt = list(range(len(ids))), ids[1:] + [IGNORE]
        ids, pos, tgt = ids[:T], pos[:T], tgt[:T]
        n = len(ids)
        rows.append(ids + [tok.pad_token_id] * (T - n))
        positions.append(pos + list(range(T - n)))  # the padding tail: its own document
        targets.append(tgt + [IGNORE] * (T - n))
    labels = torch.tensor(targets)
    labels[1, :2] = IGNORE
    return Rows.from_rows(torch.tensor(rows), labels, torch.tensor(positions) if packed else None, [T, T],
                          pad_id=tok.pad_token_id, ignore_index=IGNORE)


def student_batch(kind: str, packed: bool, T: int = 100) -> Batch:
    return student_rows(kind, packed, T).batch(torch.arange(2))


def source(student_kind: str, teacher_kind: str, model, rows: Rows, loss="gold"):
    """The live teacher of ``rows``, each read and aligned first as the job does when its rows are made."""
    s, t = tokenizer(student_kind), tokenizer(teacher_kind)
    reads = {"train": AlignedRows.build(RowReader(s, t), rows, "train", 128, t.pad_token_id)}
    return CrossTokenizerTeacher(model, reads, vocab_map_of(s, t, len(t)), loss=loss, student_vocab=len(s))


@pytest.mark.parametrize("packed", [True, False])
def test_the_students_own_tokenizer_through_the_cross_path_is_the_live_teacher(packed):
    rows = student_rows("byte_level", packed)
    batch = rows.batch(torch.arange(2))
    model = tiny_model(len(tokenizer("byte_level")), seed=0)
    s_logits = torch.randn(*batch.input_ids.shape, len(tokenizer("byte_level")), generator=torch.Generator().manual_seed(1))
    cross = source("byte_level", "byte_level", model, rows)
    for divergence in DIVERGENCES:
        kw = dict(divergence=divergence, beta=0.3, temperature=2.0, ignore_index=IGNORE, num_chunks=3)
        with LiveTeacher(model).targets(batch) as live, cross.targets(batch) as aligned:
            want = kd_loss_sums(s_logits, live, batch.labels, **kw)
            got = kd_loss_sums(s_logits, aligned, batch.labels, **kw)
        for a, b in zip(got, want):
            assert a.item() == pytest.approx(b.item(), rel=1e-5, abs=1e-6), divergence
    assert cross.kd_spans_dropped == 0 and cross.tokens_unaligned == 0 and (batch.input_ids[:, -1] == tokenizer("byte_level").pad_token_id).all()
    assert cross.kd_spans == len(DIVERGENCES) * int((batch.labels != IGNORE).sum())


def test_a_teacher_of_another_tokenizer_reads_the_same_text_and_trains_what_aligns():
    rows = student_rows("byte_level", packed=True, T=40)
    batch = rows.batch(torch.arange(2))
    s, t = tokenizer("byte_level"), tokenizer("metaspace")
    assert is_byte_level(s) is True and is_byte_level(t) is False
    reader = RowReader(s, t)
    read = reader.read(batch.input_ids[0].tolist(), batch.labels[0].tolist(),
                       {k for k, p in enumerate(batch.position_ids[0].tolist()) if p == 0})
    # the teacher's tokens are its own reading of the same documents, with its own BOS and EOS between them
    content = [i for i in read.teacher_ids if i not in (t.bos_token_id, t.eos_token_id)]
    assert t.eos_token_id in read.teacher_ids  # the EOS that ends the first document, which the student only predicts
    assert t.decode(content).replace(" ", "") in (TEXTS[0] + TEXTS[2]).replace(" ", "")
    assert read.teacher_positions[0] == 0 and read.teacher_positions.count(0) == 2  # two documents
    for loss in ("gold", "uld"):
        cross = source("byte_level", "metaspace", tiny_model(len(t), seed=2), rows, loss=loss)
        logits = torch.randn(*batch.input_ids.shape, len(s), generator=torch.Generator().manual_seed(3))
        logits.requires_grad_()
        with cross.targets(batch) as aligned:
            sums = kd_loss_sums(logits, aligned, batch.labels, ignore_index=IGNORE, num_chunks=4)
        sums.kd.backward()
        assert torch.isfinite(sums.kd) and sums.kd > 0 and torch.isfinite(logits.grad).all()
        heads = aligned.head.tolist()
        # KD terms only at trained positions; the row cut inside a word leaves its tail unaligned and counted
        assert all(batch.labels.reshape(-1)[h] != IGNORE for h in heads)
        assert 0 < cross.kd_spans < int((batch.labels != IGNORE).sum())
        untouched = torch.ones(logits.shape[:2], dtype=torch.bool).reshape(-1)
        untouched[heads] = False
        untouched[aligned.cont.tolist()] = False
        assert (logits.grad.reshape(-1, len(s))[untouched].abs().sum(-1) == 0).all()


def test_a_padded_row_is_read_once_and_a_cut_character_is_skipped_not_refused():
    s = tokenizer("byte_level")
    reader = RowReader(s, s)
    for packed in (False, True):  # a stream's rows end with EOS, a packed row's last document with padding
        batch = student_batch("byte_level", packed=packed)
        for row, labels, pos in zip(batch.input_ids.tolist(), batch.labels.tolist(), batch.position_ids.tolist()
                                    if packed else [[]] * 2):
            read = reader.read(row, labels, {k for k, p in enumerate(pos) if p == 0})
            content = [i for i in row if i != s.pad_token_id]  # the same tokenizer: the row's tokens, once each
            assert [i for i in read.teacher_ids if not packed or i != s.eos_token_id] == content
    words = s("the earth was void", add_special_tokens=False)["input_ids"]  # content, then padding at once
    read = reader.read([*words, s.pad_token_id, s.pad_token_id], [*words[1:], IGNORE, IGNORE, IGNORE])
    assert read.teacher_ids == words
    ids = s("日本 and the earth", add_special_tokens=False)["input_ids"]
    cut = ids[1:]  # the row begins inside 日: its first byte token is gone
    read = RowReader(s, tokenizer("metaspace")).read(cut)
    assert read.skipped  # the character's remaining bytes were not given to the teacher
    alignment = align_spans(read.text, read.student, read.teacher, read.skipped)
    assert alignment.spans and alignment.spans[-1].student[1] == len(cut)


def test_one_token_for_bos_and_eos_begins_a_row_and_ends_a_document():
    from transformers import PreTrainedTokenizerFast

    base = tokenizer("byte_level")
    gpt2_like = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, bos_token="</s>", eos_token="</s>",
                                        pad_token="<pad>", unk_token="<unk>")
    t = tokenizer("metaspace")
    words = gpt2_like("the earth", add_special_tokens=False)["input_ids"]
    eos = gpt2_like.eos_token_id
    row = [eos, *words, eos]
    read = RowReader(gpt2_like, t).read(row, [*row[1:], IGNORE])
    specials = [i for i in read.teacher_ids if i in (t.bos_token_id, t.eos_token_id)]
    assert specials == [t.bos_token_id, t.eos_token_id]  # the first begins (nothing predicts it), the last ends
    pairs = dict(zip(vocab_map_of(gpt2_like, t, len(t)).student.tolist(), vocab_map_of(gpt2_like, t, len(t)).teacher.tolist()))
    assert pairs[eos] == t.eos_token_id


@pytest.mark.parametrize("packed", [True, False])
def test_what_the_cache_keeps_of_a_batch_gives_the_live_loss_and_gradients(packed):
    """A cross-tokenizer teacher's cache (kdsweep.teacher.cross_cache) keeps its targets on the student's positions:
    read back, they give the live teacher's loss and gradients at the loss's temperature, and its logged distance
    at 1, with the same alignment counts (row 0 is cut inside a word)."""
    from kdsweep.teacher.cache import Spec
    from kdsweep.teacher.cross_cache import from_fields, span_fields

    rows = student_rows("byte_level", packed, T=40)
    batch = rows.batch(torch.arange(2))
    s, t = tokenizer("byte_level"), tokenizer("metaspace")
    spec = Spec(method="full", k=0, temperature=2.0, seed=0, vocab=len(t), dtype="float32", aligned=True)
    for loss in ("gold", "uld"):
        cross = source("byte_level", "metaspace", tiny_model(len(t), seed=4), rows, loss=loss)
        with cross.built(batch) as (built, unaligned):
            fields = span_fields(built, unaligned, *batch.input_ids.shape, spec)
        scoring = {"student_vocab": len(s), "loss": loss, "vocab_map": cross.vocab_map}
        kept, dropped, cut = from_fields(fields, batch.labels, spec, scoring, torch.device("cpu"),
                                         lambda cells: fields["logits"].reshape(-1, len(t))[cells])
        assert (dropped, cut) == (built.dropped, sum(unaligned)) and kept.extent == built.targets.extent
        assert 0 < len(kept.extent) < int((batch.labels != IGNORE).sum())  # the cut word's tail takes no term
        for temperature in (2.0, 1.0):
            grads = []
            for targets in (built.targets, kept):
                logits = torch.randn(*batch.input_ids.shape, len(s), generator=torch.Generator().manual_seed(5))
                logits.requires_grad_()
                sums = kd_loss_sums(logits, targets, batch.labels, ignore_index=IGNORE, temperature=temperature,
                                    num_chunks=3)
                (sums.kd + sums.kl).backward()
                grads.append((sums, logits.grad))
            (want, g_want), (got, g_got) = grads
            for a, b in zip(got, want):
                assert a.item() == pytest.approx(b.item(), rel=1e-6, abs=1e-7), (loss, temperature)
            assert torch.allclose(g_got, g_want, rtol=1e-5, atol=1e-8)
    with pytest.raises(ValueError, match="continuation at T="):  # a temperature it did not keep: never silently
        kd_loss_sums(torch.randn(*batch.input_ids.shape, len(s)), kept, batch.labels, ignore_index=IGNORE,
                     temperature=3.0)


def _sums_and_grad(targets, batch, vocab, temperature):
    logits = torch.randn(*batch.input_ids.shape, vocab, generator=torch.Generator().manual_seed(5)).requires_grad_()
    sums = kd_loss_sums(logits, targets, batch.labels, ignore_index=IGNORE, temperature=temperature, num_chunks=3)
    (sums.kd + sums.kl).backward()
    return sums, logits.grad


@pytest.mark.parametrize("loss", ["gold", "uld"])
def test_a_sparse_cache_of_a_teacher_with_another_tokenizer_keeps_each_spans_head_distribution(loss):
    """topk keeps each span head's k most likely teacher tokens and the tail's mass, spread evenly over the others:
    with k = V − 1 that is the whole distribution, and the loss, logged distance (at the cache's temperature) and
    gradients are the live teacher's; with a small k the top k are the live ones and the tail's mass too. sample keeps
    k draws, seeded by the row (not its place in the batch): the empirical distribution."""
    from dataclasses import replace

    from kdsweep.teacher.cache import Spec
    from kdsweep.teacher.cross_cache import from_fields, sparse_head, span_fields

    rows = student_rows("byte_level", True, T=40)
    batch = rows.batch(torch.arange(2))
    s, t = tokenizer("byte_level"), tokenizer("metaspace")
    cross = source("byte_level", "metaspace", tiny_model(len(t), seed=4), rows, loss=loss)
    scoring = {"student_vocab": len(s), "loss": loss, "vocab_map": cross.vocab_map}
    spec = lambda method, k: Spec(method=method, k=k, temperature=2.0, seed=3, vocab=len(t), dtype="float32",
                                  aligned=True)
    kept = {}
    with cross.built(batch) as (built, unaligned):
        live = replace(built.targets, kl_temperature=2.0)
        want_p = live.teacher.head_log_probs(2.0).exp()
        for method, k, seeds in (("topk", len(t) - 1, ()), ("topk", 12, ()), ("sample", 64, (7, 8)), ("sample", 64, (9, 8))):
            fields = span_fields(built, unaligned, *batch.input_ids.shape, spec(method, k), seeds)
            kept[method, k, seeds] = fields, from_fields(fields, batch.labels, spec(method, k), scoring,
                                                        torch.device("cpu"),
                                                        sparse_head(fields, spec(method, k), torch.device("cpu")))[0]
        (want, g_want) = _sums_and_grad(live, batch, len(s), 2.0)
    whole = kept["topk", len(t) - 1, ()][1]
    assert not whole.exact and whole.kl_temperature == 2.0 and whole.extent == live.extent
    got, g_got = _sums_and_grad(whole, batch, len(s), 2.0)
    for a, b in zip(got, want):
        assert a.item() == pytest.approx(b.item(), rel=1e-5, abs=1e-6), loss
    assert torch.allclose(g_got, g_want, rtol=1e-4, atol=1e-7)
    top = kept["topk", 12, ()][1].teacher.head_log_probs(2.0).exp()
    values, ids = want_p.topk(12, dim=-1)
    assert torch.allclose(top.gather(-1, ids), values, atol=1e-6)
    assert torch.allclose(top.sum(-1), torch.ones(len(top)), atol=1e-5)  # the tail's mass, spread over the others
    assert torch.allclose(top.scatter(-1, ids, 0.0).sum(-1), 1 - values.sum(-1), atol=1e-5)
    (fa, a), (fb, b) = kept["sample", 64, (7, 8)], kept["sample", 64, (9, 8)]
    p = a.teacher.head_log_probs(2.0).exp()
    assert torch.allclose(p * 64, (p * 64).round(), atol=1e-4) and torch.allclose(p.sum(-1), torch.ones(len(p)))
    row1 = batch.input_ids.shape[1]
    assert torch.equal(fa["ids"][1], fb["ids"][1]) and not torch.equal(fa["ids"][0], fb["ids"][0])  # by row's seed
    assert set(fa) == {"ids", "span", "cont_logp", "nll", "row_counts"} and row1 == 40
    with pytest.raises(ValueError, match="head distribution at T=2"):  # another temperature: never silently
        _sums_and_grad(whole, batch, len(s), 1.0)


def test_an_instruction_sample_is_read_in_the_teachers_tokens_and_only_its_response_takes_kd_terms():
    """kdsweep's instruction template is the same text for both models: the teacher reads the prompt as context in
    its own tokens (its own BOS for the student's), and only the response and its EOS, the trained tokens, are aligned
    and take KD terms (every one of them: the prompt's text ends where the response begins in both tokenizations); the
    prompt's positions get no gradient from the KD term."""
    from kdsweep.data.formats import FormatSpec, render

    s, t = tokenizer("byte_level"), tokenizer("metaspace")
    row = {"instruction": "Say what the earth was.", "input": "In the beginning",
           "output": "The earth was without form, and void."}
    sample = render(row, FormatSpec(kind="instruction", add_bos=True, ignore_index=IGNORE), s)
    rows = Rows.from_rows([sample.input_ids], [sample.labels], None, [len(sample)], pad_id=s.pad_token_id,
                          ignore_index=IGNORE)
    batch = rows.batch([0])
    read = RowReader(s, t).read(sample.input_ids, sample.labels)
    assert read.teacher_ids[0] == t.bos_token_id and read.teacher_ids[-1] == t.eos_token_id
    spelled = t.decode([i for i in read.teacher_ids if i not in (t.bos_token_id, t.eos_token_id)])
    assert "### Instruction:" in spelled and spelled.replace(" ", "").endswith(row["output"].replace(" ", ""))
    cross = source("byte_level", "metaspace", tiny_model(len(t), seed=4), rows)
    logits = torch.randn(1, len(sample), len(s), generator=torch.Generator().manual_seed(5), requires_grad=True)
    with cross.targets(batch) as aligned:
        sums = kd_loss_sums(logits, aligned, batch.labels, ignore_index=IGNORE, num_chunks=2)
    sums.kd.backward()
    trained = {k for k, label in enumerate(sample.labels) if label != IGNORE}
    covered = {p for a, b in aligned.extent for p in range(a, b + 1)}
    assert covered == trained and cross.kd_spans_dropped == 0 and 0 < cross.kd_spans <= len(trained)
    prompt = [k for k in range(len(sample)) if k not in covered]
    assert (logits.grad[0, prompt].abs().sum(-1) == 0).all() and logits.grad[0, sorted(covered)].abs().sum() > 0


@pytest.mark.parametrize("loss", ["gold", "uld"])
def test_fused_cross_tokenizer_kd_is_the_chunked_one_without_the_teachers_full_logits(loss):
    """loss.impl=fused with a teacher of another tokenizer: the teacher gives its final hidden states and only the
    rows a chunk's spans read are projected, one chunk at a time; the student's side is projected chunk by chunk as
    well. Values and gradients equal the chunked path's (the teacher's full logits, the student's full logits)."""
    from dataclasses import replace

    from kdsweep.train.chunked import chunked_loss_sums
    from kdsweep.train.fused import fused_loss_sums

    rows = student_rows("byte_level", True, T=40)
    batch = rows.batch(torch.arange(2))
    s, t = tokenizer("byte_level"), tokenizer("metaspace")
    teacher = tiny_model(len(t), seed=4)
    students = [tiny_model(len(s), seed=7).train() for _ in range(2)]
    kw = dict(divergence="jsd", beta=0.3, temperature=2.0, ignore_index=IGNORE)
    results, projected = [], []
    for fused, student in zip((False, True), students):
        cross = source("byte_level", "metaspace", teacher, rows, loss=loss)
        cross.fused = fused
        with cross.targets(batch) as targets:
            if fused:
                rows = targets.teacher.rows
                targets.teacher = replace(targets.teacher, rows=lambda i: projected.append(len(i)) or rows(i))
                sums, mixed = fused_loss_sums(student, batch.inputs(), targets, batch.labels, kd_ratio=0.4,
                                              num_chunks=3, **kw)
            else:
                sums, mixed = chunked_loss_sums(student(**batch.inputs()).logits, targets, batch.labels,
                                                kd_ratio=0.4, num_chunks=3, **kw)
            (mixed * 0.5).backward()
        results.append((sums, {n: p.grad for n, p in student.named_parameters()}))
    (want, g_want), (got, g_got) = results
    for a, b in zip(got, want):
        assert a.item() == pytest.approx(b.item(), rel=1e-6, abs=1e-7)
    for n in g_want:
        assert torch.allclose(g_got[n], g_want[n], rtol=1e-5, atol=1e-7), n
    assert 3 <= len(projected) and max(projected) < batch.input_ids.numel() // 2  # a chunk's rows at a time


def test_a_fused_cross_tokenizer_evaluation_keeps_no_chunk_s_teacher_rows_once_the_chunk_is_scored():
    """A teacher of another tokenizer, evaluated with the fused loss: the rows a chunk's spans read are projected for
    its distance and its teacher CE, and are gone before the next chunk's are. The teacher CE used to keep them on
    the chunk, and the batch's list of chunks kept every one."""
    import math
    import weakref
    from contextlib import contextmanager
    from dataclasses import replace

    from kdsweep.config import LossConfig
    from kdsweep.distributed import single_process
    from kdsweep.train.step import evaluate

    rows = student_rows("byte_level", True, T=40)
    batch = rows.batch(torch.arange(2))
    s, t = tokenizer("byte_level"), tokenizer("metaspace")
    cross = source("byte_level", "metaspace", tiny_model(len(t), seed=4), rows)
    cross.fused = True
    alive_at_each_projection, made = [], []

    class Tracking:
        def prefetch(self, batches):
            cross.prefetch(batches)

        @contextmanager
        def targets(self, batch):
            with cross.targets(batch) as targets:
                project = targets.teacher.rows

                def tracked(index):
                    alive_at_each_projection.append(sum(ref() is not None for ref in made))
                    out = project(index)
                    made.append(weakref.ref(out))
                    return out

                targets.teacher = replace(targets.teacher, rows=tracked)
                yield targets

    result = evaluate(tiny_model(len(s), seed=7), Tracking(), [batch], loss_cfg=LossConfig(impl="fused"),
                      dist=single_process(), chunks=4)
    assert len(alive_at_each_projection) >= 4 and max(alive_at_each_projection) == 0
    assert math.isfinite(result.teacher_ce) and result.teacher_ce > 0


@pytest.mark.parametrize("method", ["full", "topk", "sample"])
def test_the_cache_of_a_teacher_with_another_tokenizer_is_built_a_block_of_positions_at_a_time(method, monkeypatch):
    """Blocks of 3 positions (each block's spans projected alone) write what one block per row writes: the same
    logits, top tokens, draws (one stream per row through its blocks), continuations and counts."""
    from kdsweep.losses import blocks
    from kdsweep.teacher.cache import Spec
    from kdsweep.teacher.cross_cache import span_fields

    rows = student_rows("byte_level", True, T=40)
    batch = rows.batch(torch.arange(2))
    t = tokenizer("metaspace")
    spec = Spec(method=method, k=0 if method == "full" else 12, temperature=2.0, seed=3, vocab=len(t),
                dtype="float32", aligned=True)
    cross = source("byte_level", "metaspace", tiny_model(len(t), seed=4), rows, loss="gold")
    fields = []
    for elements in (blocks.BLOCK_ELEMENTS, 3 * len(t)):
        monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", elements)
        with cross.built(batch) as (built, unaligned):
            fields.append(span_fields(built, unaligned, *batch.input_ids.shape, spec, (7, 8)))
    whole, blocked = fields
    assert whole.keys() == blocked.keys() == spec.fields().keys()
    for name in whole:
        torch.testing.assert_close(blocked[name], whole[name], rtol=1e-6, atol=1e-6, msg=name)
    assert all(bool(whole[name].any()) for name in whole if name != "row_counts")  # every field holds something
