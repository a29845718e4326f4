"""A teacher with another tokenizer reads chat rows in its own template (kdsweep.teacher.views): a ChatML-like
student and a Llama-3-header-like teacher (templates built here, on real tokenizers of two conventions) are placed
on the contents they share and each turn's end; the alignment of those places equals the independent reference; the
views go through packing, padding, truncation and the rows' files; only the assistant turns take KD terms; a teacher
that does not spell its own rendering back is one line."""

from __future__ import annotations

import pytest
import torch

from helpers import one_thread  # noqa: F401
from kdsweep.config.schema import ConfigError, DataConfig
from kdsweep.data.dataset import make_rows
from kdsweep.data.formats import FormatSpec, render
from kdsweep.data.rows import Rows
from kdsweep.losses import kd_loss_sums
from kdsweep.teacher.align import align_spans
from kdsweep.teacher.aligned_rows import AlignedRows
from kdsweep.teacher.cross import CrossTokenizerTeacher, vocab_map_of
from kdsweep.teacher.views import TURN_END, TeacherViews, ViewReads
from test_align import reference_spans, spans, tokenizer
from test_cross_source import tiny_model

IGNORE = -100
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("<s>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}"
          "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATS = [
    [{"role": "system", "content": "Answer from the scriptures."}, {"role": "user", "content": "What is wisdom?"},
     {"role": "assistant", "content": "The fear of the Lord: naïve café 日本."},
     {"role": "user", "content": "And the earth?"}, {"role": "assistant", "content": " Without form, and void.  "}],
    [{"role": "user", "content": "Let there be light?"}, {"role": "assistant", "content": "And there was light."}],
]


def views():
    s, t = tokenizer("byte_level"), tokenizer("metaspace")
    return s, t, TeacherViews(s, t, LLAMA3)


def sample(messages, view):
    return render({"messages": messages}, FormatSpec(kind="chat", chat_template=CHATML, chat_view=view,
                                                     ignore_index=IGNORE), view.student)


def placed_text(text, places, pieces, ids):
    """What each placed token covers of ``text``, with the token's own bytes (less a space the place clipped)."""
    out = []
    for i, o in zip(ids, places):
        if o is not None and text[o[0]] != TURN_END:
            covered = text[o[0]:o[1]].encode("latin-1")
            assert pieces[i].endswith(covered) or pieces[i].startswith(covered), (pieces[i], covered)
            out.append(covered)
    return b"".join(out)


def test_both_renderings_are_placed_on_the_contents_and_each_turn_s_end():
    s, t, view = views()
    x = sample(CHATS[0], view)
    v = x.view
    contents = [m["content"].strip() for m in CHATS[0] if m["role"] == "assistant"]
    assert v.text == "".join(c.encode().decode("latin-1") + TURN_END for c in contents)
    ids = [*x.input_ids, x.labels[-1]]
    assert len(v.student) == len(ids) and v.teacher_ids == t(t.apply_chat_template(
        CHATS[0], chat_template=LLAMA3, tokenize=False), add_special_tokens=False)["input_ids"]  # its own rendering
    from kdsweep.teacher.views import token_bytes

    for side, places, tok, tok_ids in (("student", v.student, s, ids), ("teacher", v.teacher, t, v.teacher_ids)):
        assert placed_text(v.text, places, token_bytes(tok), tok_ids) == "".join(contents).encode(), side
        ends = [tok.convert_ids_to_tokens(i) for i, o in zip(tok_ids, places) if o and v.text[o[0]] == TURN_END]
        assert ends == [{"student": "<|im_end|>", "teacher": "<|eot_id|>"}[side]] * 2, side  # each turn's end
        template = {tok.convert_ids_to_tokens(i) for i, o in zip(tok_ids, places) if o is None}
        assert {"<|im_start|>", "<|start_header_id|>"} & template and "<s>" not in {
            tok.convert_ids_to_tokens(i) for i, o in zip(tok_ids, places) if o}
    # the student trains on exactly what it trained on without the teacher's view
    plain = render({"messages": CHATS[0]}, FormatSpec(kind="chat", chat_template=CHATML, ignore_index=IGNORE), s)
    assert (plain.input_ids, plain.labels) == (x.input_ids, x.labels)
    got = spans(v.text, v.student, v.teacher)
    assert got == reference_spans(v.text, v.student, v.teacher) and len(got) >= 6


@pytest.mark.parametrize("sequences", ["pack", "pad"])
def test_views_go_through_rows_and_their_files_and_only_assistant_turns_take_kd_terms(sequences, tmp_path):
    s, t, view = views()
    samples = [sample(m, view) for m in CHATS * 2]
    cfg = DataConfig(sequences=sequences, seq_len=96 if sequences == "pack" else 48)  # pad: the long chats cut at 48
    rows, stats = make_rows(samples, cfg, s.pad_token_id, IGNORE)
    rows.save(tmp_path / "train.pt")
    loaded = Rows.load(tmp_path / "train.pt")
    assert loaded.views is not None and len(loaded.views) == len(rows) and loaded.head(1).views.row(0) == rows.views.row(0)
    assert [len(loaded.views.row(i)) for i in range(len(rows))] == (
        [len(r) for r in (rows.views.row(i) for i in range(len(rows)))])
    if sequences == "pad":
        assert stats["truncated"] == 2
    reads = ViewReads({"train": loaded.views})
    batch = loaded.batch(torch.arange(len(loaded)))
    row_reads = reads.read_batch(batch, "train", IGNORE)
    for r, read in enumerate(row_reads):
        alignment = align_spans(read.text, read.student, read.teacher, read.skipped)
        covered = max(o[1] for o in read.student if o is not None)
        assert all(o is None or o[0] < covered for o in read.teacher)  # a cut sample's teacher stops where it does
        assert alignment.spans
        assert read.teacher_positions.count(0) == len(loaded.views.row(r))  # each document from 0
    aligned_rows = {"train": AlignedRows.build(reads, loaded, "train", 128, t.pad_token_id)}
    cross = CrossTokenizerTeacher(tiny_model(len(t), seed=7), aligned_rows, vocab_map_of(s, t, len(t)), loss="gold",
                                  student_vocab=len(s))
    logits = torch.randn(*batch.input_ids.shape, len(s), generator=torch.Generator().manual_seed(8), requires_grad=True)
    with cross.targets(batch) as aligned:
        sums = kd_loss_sums(logits, aligned, batch.labels, ignore_index=IGNORE, num_chunks=3)
    sums.kd.backward()
    flat = batch.labels.reshape(-1)
    heads = aligned.head.tolist()
    assert heads and all(flat[h] != IGNORE for h in heads) and torch.isfinite(sums.kd)
    touched = torch.zeros(flat.shape, dtype=torch.bool)
    touched[heads] = True
    touched[aligned.cont.tolist()] = True
    assert not touched[flat == IGNORE].any()  # no KD term on the system, user or template positions
    grads = logits.grad.reshape(-1, len(s)).abs().sum(-1)
    assert (grads[~touched] == 0).all() and (grads[touched] > 0).all()
    # the trained positions that take no KD term: those predicting what only the student's template writes (the
    # newline after <|im_end|>, a content's own leading and trailing spaces), and those of a span a cut left out
    T = batch.input_ids.shape[1]
    placeless = {r * T + p for r, read in enumerate(row_reads) for o, p in zip(read.student, read.predictor)
                 if o is None and p is not None and flat[r * T + p] != IGNORE}
    untaken = set(((flat != IGNORE) & ~touched).nonzero().squeeze(-1).tolist())
    assert placeless <= untaken and len(untaken - placeless) <= 4 * cross.kd_spans_dropped, (untaken, placeless)
    assert placeless and all(s.decode([int(flat[k])]).strip() == "" for k in placeless)
    # whole chats leave no span out; a chat cut at seq_len leaves at most the one the cut went through
    assert cross.kd_spans_dropped <= (0 if sequences == "pack" else stats["truncated"]) and cross.kd_spans > 0


def test_a_teacher_that_changes_its_rendering_is_one_line():
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast

    s, t = tokenizer("byte_level"), tokenizer("metaspace")
    backend = t.backend_tokenizer.__class__.from_str(t.backend_tokenizer.to_str())
    backend.normalizer = normalizers.Lowercase()
    lower = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                    unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>",
                                    "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    with pytest.raises(ConfigError) as e:
        sample(CHATS[1], TeacherViews(s, lower, LLAMA3))
    line = str(e.value)
    assert "\n" not in line and line.startswith("teacher (row)") and "its normalisation changes the text" in line
    assert "reads 'Let there be light?" in line and "as 'let there be" in line  # what it read, and as what
