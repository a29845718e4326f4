"""Aligning two tokenizations by characters (kdsweep.teacher.align): hand-built cases, and real tokenizers of two
conventions (byte-level BPE with Ġ; SentencePiece-style ▁ with byte fallback) checked against an independent
reference (spans as the common cut points of both sides), including chat templates of two styles."""

from __future__ import annotations

import functools

import pytest

from kdsweep.teacher.align import Span, align_spans, piece_bytes, shared_vocab, snap


def spans(text, student, teacher):
    return [(s.student, s.teacher) for s in align_spans(text, student, teacher).spans]


def test_one_teacher_token_over_two_student_tokens_and_the_reverse():
    text = "unhappy cats"
    student = [(0, 2), (2, 7), (7, 12)]  # un | happy | ␣cats
    teacher = [(0, 7), (7, 9), (9, 12)]  # unhappy | ␣c | ats
    assert spans(text, student, teacher) == [((0, 2), (0, 1)), ((2, 3), (1, 3))]
    assert align_spans(text, student, teacher).spans[0] == Span((0, 2), (0, 1), (0, 7))


def test_leading_space_conventions_agree_and_a_lone_space_joins_the_span_after():
    text = "a  word"
    student = [(0, 1), (1, 2), (2, 7)]  # a | Ġ | Ġword  (byte-level: the spaces in the tokens)
    teacher = [(0, 1), (3, 7)]  # ▁a | ▁word reported without its space
    assert spans(text, student, teacher) == [((0, 1), (0, 1)), ((1, 3), (1, 2))]


def test_whitespace_pairs_only_with_the_same_whitespace():
    text = "a  \n  b"
    student = [(0, 1), (1, 6), (6, 7)]  # a | ␣␣\n␣␣ | b
    teacher = [(0, 1), (1, 3), (3, 7)]  # a | ␣␣ | \n␣␣b
    assert spans(text, student, teacher) == [((0, 1), (0, 1)), ((1, 3), (1, 3))]


def test_one_tokenization_against_itself_is_one_token_spans():
    text = "the  cat,  日本"
    tokens = [(0, 3), (3, 4), (4, 9), (9, 10), (10, 11), (11, 12), (11, 13), (12, 13)]  # spaces; byte tokens
    got = spans(text, tokens, tokens)
    assert got[:5] == [((k, k + 1), (k, k + 1)) for k in range(5)]
    assert got[5:] == [((5, 8), (5, 8))]  # the bytes of 日本 overlap: one span


def test_the_bytes_of_one_character_stay_in_one_span():
    text = "日本 x"
    student = [(0, 1), (0, 2), (1, 2), (2, 4)]  # byte tokens: a character's bytes report its offsets
    teacher = [(0, 1), (1, 2), (2, 4)]
    # the second student token holds the last byte of 日 and the first of 本: the two characters are one span
    assert spans(text, student, teacher) == [((0, 3), (0, 2)), ((3, 4), (2, 3))]


def test_special_and_template_tokens_are_never_aligned():
    text = "hi there"
    student = [None, (0, 2), (2, 8), None]  # <s> hi ␣there </s>
    teacher = [None, None, (0, 2), (2, 5), (5, 8)]  # <|im_start|> user\n hi ␣th ere
    assert spans(text, student, teacher) == [((1, 2), (2, 3)), ((2, 3), (3, 5))]


def test_a_cut_inside_a_span_leaves_it_out_and_counts_it():
    text = "one two three"
    student = [(0, 3), (3, 7), (7, 10)]  # the row ends inside " three"
    teacher = [(0, 3), (3, 7), (7, 13)]
    alignment = align_spans(text, student, teacher)
    assert [(s.student, s.teacher) for s in alignment.spans] == [((0, 1), (0, 1)), ((1, 2), (1, 2))]
    assert alignment.unaligned == (1, 1)


def test_text_one_side_changed_is_one_line():
    text = "café au lait"
    student = [(0, 4), (4, 7), (7, 12)]
    teacher = [(0, 3), (4, 7), (7, 12)]  # the é was dropped: lossy normalisation
    with pytest.raises(ValueError, match="cover different characters") as e:
        align_spans(text, student, teacher)
    assert "\n" not in str(e.value)


# -- real tokenizers and an independent reference ------------------------------------------------------------------

CORPUS = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "Blessed are the meek: for they shall inherit the earth. Café, naïve, 日本語, ünïcödé.",
    "user: what is wisdom?\nassistant: the fear of the Lord is the beginning of wisdom.",
] * 10
TEXTS = [
    "And God said, Let there be light: and there was light.",
    "the  meek   shall inherit\tthe earth\n\nnaïve café 日本 ẞ 🙂 xyzzy",
    "Wisdom is the principal thing; therefore get wisdom: and with all thy getting get understanding.",
    " leading space, trailing space ",
]


@functools.lru_cache(maxsize=None)
def tokenizer(kind: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<s>", "</s>", "<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eot_id|>"]
    if kind == "byte_level":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
        trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False, limit_alphabet=60,
                                      special_tokens=[*special, *(f"<0x{b:02X}>" for b in range(256))])
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=special[4:])


def offsets(kind: str, text: str) -> list[tuple[int, int]]:
    return tokenizer(kind)(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]


def reference_spans(text, student, teacher):
    """Independent of the two-pointer walk. A side can be cut after its k-th content token when every later token
    ends (as written) beyond what tokens 0..k cover and starts at or after their end with whitespace stripped (b);
    from the last cut (i, j), the next is the pair of cuts (k_s > i, k_t > j) of one boundary b, the smallest b
    first, then the fewest tokens."""
    def cuts(offs):
        idx = [i for i, o in enumerate(offs) if o is not None]
        raw = [offs[i][1] for i in idx]
        ends = [snap(text, e) for e in raw]
        starts = [offs[i][0] for i in idx]
        out = []
        for k in range(len(idx)):
            b = max(ends[: k + 1])
            if all(e > max(raw[: k + 1]) for e in raw[k + 1:]) and all(s >= b for s in starts[k + 1:]):
                out.append((b, k + 1))  # tokens idx[:k + 1] lie before b
        return idx, out

    s_idx, s_cuts = cuts(student)
    t_idx, t_cuts = cuts(teacher)
    result, i, j = [], 0, 0
    while True:
        pairs = sorted((b, ks, kt) for b, ks in s_cuts for c, kt in t_cuts if c == b and ks > i and kt > j)
        if not pairs:
            return result
        _, ks, kt = pairs[0]
        result.append(((s_idx[i], s_idx[ks - 1] + 1), (t_idx[j], t_idx[kt - 1] + 1)))
        i, j = ks, kt


@pytest.mark.parametrize("text", TEXTS)
def test_real_tokenizations_of_two_conventions_match_the_reference(text):
    student, teacher = offsets("byte_level", text), offsets("metaspace", text)
    got = spans(text, student, teacher)
    assert got == reference_spans(text, student, teacher)
    assert spans(text, teacher, student) == [(t, s) for s, t in got]  # the same spans, whichever side is which
    # every content character lies in a span (nothing is cut here), and spans are 1:1 where the words agree
    covered = {c for s, _ in got for k in range(*s) for c in range(*student[k])}
    assert {c for c, ch in enumerate(text) if not ch.isspace()} <= covered
    assert any(s[1] - s[0] == 1 and t[1] - t[0] == 1 for s, t in got)


def test_the_two_conventions_give_spans_of_several_tokens_on_either_side():
    got = [span for text in TEXTS for span in spans(text, offsets("byte_level", text), offsets("metaspace", text))]
    assert any(s[1] - s[0] > 1 for s, _ in got) and any(t[1] - t[0] > 1 for _, t in got)


def chatml(messages):
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def llama3(messages):
    body = "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>" for m in messages)
    return "<s>" + body


def content_offsets(kind, render, messages):
    """Offsets of ``render``'s tokens moved into the coordinates of the messages' contents joined (None for the
    template's own text and special tokens), as a data pipeline gives them."""
    rendered = render(messages)
    starts, pos, joined = [], 0, 0
    for m in messages:
        at = rendered.index(m["content"], pos)
        starts.append((at, at + len(m["content"]), joined))
        pos, joined = at + len(m["content"]), joined + len(m["content"]) + 1
    enc = tokenizer(kind)(rendered, add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for a, b in enc["offset_mapping"]:
        inside = [(lo, shift) for lo, hi, shift in starts if lo <= a and b <= hi and a < b]
        out.append((a - inside[0][0] + inside[0][1], b - inside[0][0] + inside[0][1]) if inside else None)
    return "\n".join(m["content"] for m in messages), out


def test_two_chat_templates_align_on_the_contents_only():
    messages = [{"role": "user", "content": "What is wisdom?"},
                {"role": "assistant", "content": "The fear of the Lord: naïve café 日本."}]
    text, student = content_offsets("byte_level", chatml, messages)
    text2, teacher = content_offsets("metaspace", llama3, messages)
    assert text == text2
    got = spans(text, student, teacher)
    assert got == reference_spans(text, student, teacher) and got
    for s, t in got:  # no template token in any span
        assert all(student[k] is not None for k in range(*s)) and all(teacher[k] is not None for k in range(*t))
    words = {text[a.chars[0]:a.chars[1]].strip() for a in align_spans(text, student, teacher).spans}
    assert "wisdom?" in words or "wisdom" in words


def entries(kind):
    tok = tokenizer(kind)
    special = set(tok.all_special_ids)
    return [(i, *piece_bytes(p, kind == "byte_level")) for p, i in tok.get_vocab().items() if i not in special]


def test_the_shared_vocabulary_pairs_entries_that_are_the_same_bytes():
    pairs = shared_vocab(entries("byte_level"), entries("metaspace"))
    s, t = tokenizer("byte_level"), tokenizer("metaspace")
    assert len(pairs) > 50
    checked = 0
    for a, b in pairs:  # each tokenizer's own decoder gives the pair's entries the same text
        mine = s.convert_tokens_to_string(s.convert_ids_to_tokens([a]))
        theirs = t.convert_tokens_to_string(["\u2581a", t.convert_ids_to_tokens(b)])[1:]  # "a" keeps ▁'s space
        if "\ufffd" not in mine + theirs:  # a lone byte of a longer character decodes to nothing printable
            assert mine == theirs, (s.convert_ids_to_tokens(a), t.convert_ids_to_tokens(b))
            checked += 1
    assert checked > 50
    by_piece = {s.convert_ids_to_tokens(a): t.convert_ids_to_tokens(b) for a, b in pairs}
    assert by_piece["Ġthe"] == "\u2581the" and by_piece["e"] == "e"
    assert piece_bytes("<0xE6>", False) == (b"\xe6", True) and piece_bytes("æĹ", True) == ("日".encode()[:2], False)
    assert len({b for _, b in pairs}) == len(pairs)  # one teacher entry per shared string
