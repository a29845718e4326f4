"""Which characters of a rendered conversation are assistant turns: what a chat sample trains on.

The text a model is trained and served on is the template's rendering of the *whole* conversation, ``full``. Many
current templates are not prefix-preserving: Qwen3 gives the last assistant turn an empty ``<think>`` block that
earlier turns lose once a later user turn follows, others move the system prompt or rewrite tool calls. So a
turn is located in ``full`` itself, never in the rendering of a shorter conversation:

1. **Markers.** Each assistant message's content gets a unique marker (private-use code points, which no template
   trims or escapes) right after its last non-space character, and the conversation is rendered once more. That
   rendering less its markers must be ``full`` exactly; otherwise the template rewrites the contents it is given
   and the turns cannot be located (one line naming the row). A marker says where its turn's content ends in
   ``full``.
2. **Start.** Assistant turn ``i`` starts where generation starts: after the generation prompt,
   ``render(messages[:i], add_generation_prompt=True)``. That prompt is found in ``full`` from its last marker
   (the turn before it; none: the start of the text): the prompt's text after that marker must follow the same
   marker in ``full``. Failing that (a template that renders the context differently before a generation), after
   the last occurrence of the generation header (the prompt less ``render(messages[:i])``) before the turn's end.
   Everything from there to the content's end is trained on: the content, and what the template writes before it
   in that position (Qwen3's ``<think>…</think>`` block).
3. **End.** The turn ends with what the template writes after its content when it is the last message
   (``render(messages[:i + 1])`` after the marker: the end-of-turn token and its newline), as far as ``full``
   continues with the same characters.

4. **Content.** Where the turn's content itself lies (a second model with its own template reads the same contents:
   kdsweep.teacher.views): the marker's position less the content's length, the surrounding whitespace stripped.

For a template that only appends, these are exactly the spans between ``render(messages[:i], True)`` and
``render(messages[:i + 1])``, so its samples are unchanged. A rollout's prompt (the text before the last trained
span) is the generation prompt of the last assistant turn as the template renders it.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from kdsweep.config.schema import ConfigError

_MARK = re.compile("\ue000[0-9]+\ue001")


def _mark(i: int) -> str:
    return f"\ue000{i}\ue001"


class Rendering(NamedTuple):
    """A template's rendering of a conversation and where its assistant turns lie in it."""

    full: str
    """The template's text of the whole conversation."""
    spans: list[tuple[int, int]]
    """The ``[start, end)`` characters of ``full`` each assistant turn trains on."""
    contents: list[tuple[int, int]]
    """Per assistant turn, where its content (less surrounding whitespace) lies in ``full``; an empty span at the
    content's end where the template writes it otherwise."""


def assistant_spans(messages: Sequence[Mapping[str, Any]], render: Callable[..., str], where: str,
                    fix: str = "data.chat_template") -> Rendering:
    """``full``, the ``[start, end)`` character span of every assistant turn in it, and where each turn's content is.

    ``render(messages, prompt)`` is the template's text of a conversation (``prompt``: with the generation prompt);
    ``fix``: the setting an error names (whose template it is).
    """
    full = render(messages)
    marked_messages = [dict(m, content=_marked(m["content"], i)) if m["role"] == "assistant" else m
                       for i, m in enumerate(messages)]
    marked = render(marked_messages)
    if _MARK.sub("", marked) != full:
        raise ConfigError(f"{where}: the chat template changes the message contents it is given, so assistant turns "
                          f"cannot be located in its rendering; fix the row or set {fix}")
    spans, contents = [], []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        mark = _mark(i)
        content_end = marked.find(mark)
        if content_end < 0:
            raise ConfigError(f"{where}: the chat template leaves out the content of message {i} (an assistant turn), "
                              f"so it cannot be trained on; fix the row or set {fix}")
        start = _generation_start(marked_messages[:i], render, marked, content_end)
        if start is None:
            raise ConfigError(
                f"{where}: the chat template renders the conversation before message {i} (an assistant turn) "
                f"differently from its generation prompt, so the turn cannot be located; fix the row or set {fix}"
            )
        through = render(marked_messages[:i + 1])
        at = through.rfind(mark)  # the turn's closing text, where the template writes the turn as the last one
        closing = through[at + len(mark):] if at >= 0 else ""
        after = content_end + len(mark)
        end = after + _common_prefix(closing, marked[after:])
        spans.append((_unmarked(marked, start), _unmarked(marked, end)))
        core, content_end = m["content"].strip(), _unmarked(marked, content_end)
        begins = content_end - len(core) if full[:content_end].endswith(core) else content_end
        contents.append((begins, content_end))
    return Rendering(full, spans, contents)


def _marked(content: str, i: int) -> str:
    core = content.rstrip()
    return core + _mark(i) + content[len(core):]


def _generation_start(before: list[Mapping[str, Any]], render: Callable[..., str], marked: str,
                      content_end: int) -> int | None:
    """Where generation starts in ``marked`` for a turn that follows ``before``, or None where it cannot be found."""
    prompt = render(before, True)
    marks = list(_MARK.finditer(prompt))
    anchor, tail = 0, prompt
    if marks:
        at = marked.find(marks[-1].group())
        anchor, tail = (at + len(marks[-1].group()), prompt[marks[-1].end():]) if at >= 0 else (0, None)
    if tail is not None and marked.startswith(tail, anchor) and anchor + len(tail) <= content_end:
        return anchor + len(tail)
    context = render(before)
    header = prompt[len(context):] if prompt.startswith(context) else ""
    found = marked.rfind(header, anchor, content_end) if header else -1
    return None if found < 0 else found + len(header)


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _unmarked(marked: str, pos: int) -> int:
    """Position ``pos`` of ``marked`` in the text without markers."""
    return pos - sum(len(m.group()) for m in _MARK.finditer(marked, 0, pos))
