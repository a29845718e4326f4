"""Rendering rows into (input_ids, shifted labels): text, instruction, chat; prompt masking; one-line errors."""

import pytest

from helpers import byte_level_bpe, word_tokenizer
from kdsweep.config.schema import ConfigError
from kdsweep.data.formats import FormatSpec, Sample, render, shift

IGNORE = -100
WORD_CHAT = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "How are you?"},
    {"role": "assistant", "content": "I am fine."},
    {"role": "user", "content": "The cat?"},
    {"role": "assistant", "content": "It sat on the mat."},
]


def words(tok, ids):
    """Tokens of ids, '_' for ignored labels."""
    return [tok.convert_ids_to_tokens(i) if i != IGNORE else "_" for i in ids]


@pytest.fixture(scope="module")
def tok():
    t = word_tokenizer(("user", "assistant", "system", "###", "Instruction", "Input", "Response", ":"))
    t.chat_template = WORD_CHAT
    return t


@pytest.fixture(scope="module")
def chatml():
    """A byte-level BPE trained here, with ChatML special tokens and a template marking assistant generations."""
    from transformers import PreTrainedTokenizerFast

    corpus = ["Hello there. How are you today?", "I am fine, thank you. The cat sat on the mat.", "You are helpful."]
    bpe = byte_level_bpe(corpus, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], vocab_size=300)
    t = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    t.chat_template = CHATML
    return t


def test_shift_follows_the_batch_convention():
    # labels[t] is the target of inputs[t]: the next token, or IGNORE where that token is not trained on
    assert shift([10, 11, 12, 13], [True, False, True, True]) == Sample([10, 11, 12], [IGNORE, 12, 13])


def test_text_trains_on_every_token_and_eos(tok):
    s = render({"text": "the cat sat"}, FormatSpec(kind="text"), tok)
    assert words(tok, s.input_ids) == ["the", "cat", "sat"]
    assert words(tok, s.labels) == ["cat", "sat", "</s>"]
    s = render({"body": "the cat"}, FormatSpec(kind="text", text_column="body", add_bos=True), tok)
    assert words(tok, s.input_ids) == ["<s>", "the", "cat"] and words(tok, s.labels) == ["the", "cat", "</s>"]


def test_instruction_masks_the_prompt_and_keeps_response_and_eos(tok):
    row = {"instruction": "the cat", "input": "on a mat", "output": "sat"}
    s = render(row, FormatSpec(kind="instruction"), tok)
    prompt = ["###", "Instruction", ":", "the", "cat", "###", "Input", ":", "on", "a", "mat", "###", "Response", ":"]
    assert words(tok, s.input_ids) == prompt + ["sat"]
    assert words(tok, s.labels) == ["_"] * (len(prompt) - 1) + ["sat", "</s>"]
    full = render(row, FormatSpec(kind="instruction", train_on_prompt=True), tok)
    assert full.input_ids == s.input_ids and words(tok, full.labels) == prompt[1:] + ["sat", "</s>"]


def test_instruction_without_input_and_custom_columns(tok):
    spec = FormatSpec(kind="instruction", instruction_column="q", input_column=None, output_column="a")
    s = render({"q": "dogs", "a": "ran over hills"}, spec, tok)
    prompt = ["###", "Instruction", ":", "dogs", "###", "Response", ":"]
    assert words(tok, s.input_ids) == prompt + ["ran", "over", "hills"]
    assert words(tok, s.labels) == ["_"] * 6 + ["ran", "over", "hills", "</s>"]
    row = {"instruction": "dogs", "input": " ", "output": "ran over hills"}
    empty_input = render(row, FormatSpec(kind="instruction"), tok)
    assert empty_input.input_ids == s.input_ids  # an empty input drops the Input section


def test_chat_keeps_assistant_turns_only(tok):
    messages = [
        {"role": "system", "content": "the cat"},
        {"role": "user", "content": "sat on"},
        {"role": "assistant", "content": "a mat"},
        {"role": "user", "content": "dogs"},
        {"role": "assistant", "content": "ran"},
    ]
    s = render({"messages": messages}, FormatSpec(kind="chat"), tok)
    assert words(tok, s.input_ids) == [
        "system", "the", "cat", "</s>", "user", "sat", "on", "</s>", "assistant", "a", "mat", "</s>",
        "user", "dogs", "</s>", "assistant", "ran",
    ]
    assert words(tok, s.labels) == ["_"] * 8 + ["a", "mat", "</s>"] + ["_"] * 4 + ["ran", "</s>"]
    everything = render({"messages": messages}, FormatSpec(kind="chat", train_on_prompt=True), tok)
    assert everything.labels == everything.input_ids[1:] + [tok.eos_token_id]


def test_sharegpt_rows_read_as_the_same_conversation(tok):
    """ShareGPT's {from, value} (human, gpt, system) render and mask exactly as {role, content}; an instruction row
    without the default input column has no input."""
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    messages = [{"role": "system", "content": "the cat"}, {"role": "user", "content": "sat on"},
                {"role": "assistant", "content": "a mat"}]
    shared = [{"from": roles[m["role"]], "value": m["content"]} for m in messages]
    spec = FormatSpec(kind="chat", messages_column="conversations")
    assert render({"conversations": shared}, spec, tok) == render({"messages": messages}, FormatSpec(kind="chat"), tok)
    no_input = render({"instruction": "the cat", "output": "sat"}, FormatSpec(kind="instruction"), tok)
    empty = render({"instruction": "the cat", "input": "", "output": "sat"}, FormatSpec(kind="instruction"), tok)
    assert no_input == empty


def test_chat_with_an_assistant_first_turn_and_an_explicit_template(tok):
    template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"  # no generation prompt
    row = {"messages": [{"role": "assistant", "content": "the cat"}]}
    s = render(row, FormatSpec(kind="chat", chat_template=template), tok)
    assert words(tok, s.input_ids) == ["assistant", "the", "cat"] and words(tok, s.labels) == ["the", "cat", "</s>"]


def test_chatml_bpe_masks_match_the_templates_generation_marks(chatml):
    s = render({"messages": CONVERSATION}, FormatSpec(kind="chat"), chatml)
    reference = chatml.apply_chat_template(CONVERSATION, return_dict=True, return_assistant_tokens_mask=True)
    ids, marks = reference["input_ids"], reference["assistant_masks"]
    assert s.input_ids == ids[:-1]
    assert s.labels == [i if m else IGNORE for i, m in zip(ids[1:], marks[1:])]
    kept = chatml.decode([i for i in s.labels if i != IGNORE])
    assert kept == "I am fine.<|im_end|>\nIt sat on the mat.<|im_end|>\n"
    assert chatml.decode(s.input_ids) == chatml.apply_chat_template(CONVERSATION, tokenize=False)[: -len("\n")]


def test_a_reply_token_that_starts_in_the_generation_prompt_is_kept(chatml):
    """Byte-level BPE merges the space ending "assistant " into the reply's first word (" The"): that token is part
    of the reply the model must learn, and HF's {% generation %} mask keeps it too."""
    template = CHATML.replace("<|im_start|>{{ m['role'] }}\n", "<|im_start|>{{ m['role'] }} ").replace(
        "<|im_start|>assistant\n", "<|im_start|>assistant ")
    conversation = [{"role": "user", "content": "How are you?"}, {"role": "assistant", "content": "The cat sat."},
                    {"role": "user", "content": "And you?"}, {"role": "assistant", "content": "fine, thank you."}]
    s = render({"messages": conversation}, FormatSpec(kind="chat", chat_template=template), chatml)
    reference = chatml.apply_chat_template(conversation, chat_template=template, return_dict=True,
                                           return_assistant_tokens_mask=True)
    ids, marks = reference["input_ids"], reference["assistant_masks"]
    assert s.labels == [i if m else IGNORE for i, m in zip(ids[1:], marks[1:])]
    kept = [i for i in s.labels if i != IGNORE]
    assert chatml.convert_ids_to_tokens(kept[0]) == "ĠThe"  # the space of "assistant " and "The", one token


def test_the_embedded_tiny_tokenizer_keeps_whole_replies_and_masks_prompts():
    from transformers import AutoTokenizer

    from kdsweep.models import zoo

    tiny = AutoTokenizer.from_pretrained(zoo.tokenizer_dir())
    template = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant> {% endif %}")
    row = {"messages": [{"role": "user", "content": "In the beginning"},
                        {"role": "assistant", "content": "God created the heaven and the earth."}]}
    s = render(row, FormatSpec(kind="chat", chat_template=template), tiny)
    kept = tiny.decode([i for i in s.labels if i != IGNORE])
    assert kept == " God created the heaven and the earth.\n"  # "ĠGod" straddles "> " and the reply: kept
    inst = render({"instruction": "Say it", "input": "", "output": "Let there be light"}, FormatSpec(kind="instruction"), tiny)
    assert tiny.decode([i for i in inst.labels if i != IGNORE]) == "Let there be light</s>"
    assert tiny.decode(inst.input_ids).startswith("### Instruction:\nSay it\n\n### Response:\n")


def test_a_template_that_fails_on_a_row_is_one_line(tok):
    template = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}" \
               "{% endif %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ConfigError, match=r"^chat.jsonl row 4: the chat template fails on this row \(.*no system role") as e:
        render({"messages": CONVERSATION}, FormatSpec(kind="chat", chat_template=template), tok, where="chat.jsonl row 4")
    assert "\n" not in str(e.value)


def test_unknown_format_is_one_line():
    with pytest.raises(ConfigError, match=r"unknown data format 'sharegpt'; use one of text, instruction, chat$"):
        FormatSpec(kind="sharegpt")


@pytest.mark.parametrize(
    ("row", "spec", "match"),
    [
        ({"prompt": "x"}, FormatSpec(kind="text", source="data.datasets[2]"),
         r"^rows\.jsonl row 4: no column 'text' \(columns: prompt\); set data\.datasets\[2\]\.text_column"),
        ({"instruction": "a", "input": "", "response": "b"}, FormatSpec(kind="instruction"),
         r"no column 'output' \(columns: instruction, input, response\); set data\.datasets\[i\]\.output_column"),
        ({"instruction": "a", "output": "b"}, FormatSpec(kind="instruction", input_column="context"),
         r"no column 'context'.*set data\.datasets\[i\]\.input_column"),
        ({"text": 3}, FormatSpec(kind="text"), r"column 'text' holds int, not text"),
        ({"text": "x"}, FormatSpec(kind="chat"),
         r"^rows\.jsonl row 4: a chat row needs a non-empty list of messages in column 'messages', got nothing"),
        ({"messages": []}, FormatSpec(kind="chat"), r"needs a non-empty list of messages"),
        ({"messages": "hi"}, FormatSpec(kind="chat"), r"needs a non-empty list of messages .*got str 'hi'"),
        ({"messages": [{"role": "user"}]}, FormatSpec(kind="chat"),
         r"message 0 is .* not \{'role': str, 'content': str\}"),
        ({"conversations": [{"from": "human", "value": "x"}]}, FormatSpec(kind="chat"),
         r"column 'messages', got nothing; fix the row or set data\.datasets\[i\]\.messages_column=conversations "
         r"\(the row has it\)$"),
        ({"messages": [{"from": "bot", "value": "x"}]}, FormatSpec(kind="chat"),
         r"message 0 is from 'bot', which is not one of ShareGPT's roles \(system, human, user, gpt, "),
    ],
)
def test_bad_rows_are_one_line(tok, row, spec, match):
    with pytest.raises(ConfigError, match=match) as err:
        render(row, spec, tok, where="rows.jsonl row 4")
    assert "\n" not in str(err.value)


def test_a_tokenizer_without_a_chat_template_is_one_line():
    plain = word_tokenizer(("user",))
    match = r"format 'chat' needs a chat template and tokenizer .* has none; set data\.chat_template"
    with pytest.raises(ConfigError, match=match) as err:
        render({"messages": [{"role": "user", "content": "the"}]}, FormatSpec(kind="chat"), plain)
    assert "\n" not in str(err.value)


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    rewrites = (
        "{% for m in messages %}{% if not loop.last %}{{ m['role'] }} {% endif %}{{ m['content'] }} </s> {% endfor %}"
    )
    row = {"messages": [{"role": "user", "content": "the"}, {"role": "assistant", "content": "cat"}]}
    with pytest.raises(ConfigError, match=r"^row: the chat template renders the conversation before message 1 \(an "
                                          r"assistant turn\) differently from its generation prompt, .*set data\.chat_template$"):
        render(row, FormatSpec(kind="chat", chat_template=rewrites), tok)
