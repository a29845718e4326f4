"""Render one dataset row into a training sample: ``input_ids`` and already-shifted ``labels``.

A row is rendered to its full token list ``x[0..n-1]`` and a per-token flag "this token is trained on". The
sample is ``input_ids = x[:-1]`` and ``labels[t] = x[t+1]`` where ``x[t+1]`` is trained on, else ``ignore_index``
(the convention of :class:`kdsweep.data.batch.Batch`: labels already shifted, same length as the inputs). A document's
first token is therefore never a label, which is what keeps packed documents independent.

Formats (``FormatSpec.kind``):

* ``text``: ``row[text_column]`` + EOS, every token trained on.
* ``instruction`` (alpaca-style): the prompt is rendered with :data:`INSTRUCTION_TEMPLATE` (or
  :data:`INSTRUCTION_TEMPLATE_NO_INPUT` when the input is empty); the response ``row[output_column]`` + EOS is
  trained on, the prompt masked. Prompt and response are tokenized separately, so the boundary is exact.
* ``chat``: ``row[messages_column]`` is a list of ``{"role", "content"}`` messages, or ShareGPT's ``{"from",
  "value"}`` (``human``, ``gpt``, …: :data:`SHAREGPT_ROLES`; an assistant message may also
  carry ``reasoning_content``) rendered by the tokenizer's own chat template (or ``FormatSpec.chat_template``), as
  the family ships it. Assistant turns are trained on, everything else masked. Each turn is located in the
  rendering of the whole conversation (:mod:`kdsweep.data.chat`): from where generation starts to its end-of-turn
  marker, so templates that rewrite earlier turns once later ones follow (Qwen3's reasoning template) work as
  shipped. Tokens that overlap a turn are kept (offsets of a fast tokenizer), as transformers' ``{% generation %}``
  masks do. A template that changes or drops the contents it is given is refused with one line.

With ``train_on_prompt`` every token is trained on. ``add_bos`` prepends the tokenizer's BOS to text and
instruction samples (chat templates write their own). Errors are :class:`~kdsweep.config.schema.ConfigError`,
one line naming the row and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from kdsweep.config.schema import FORMATS, ConfigError, DatasetConfig
from kdsweep.data.chat import assistant_spans

INSTRUCTION_TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
"""Prompt of an instruction row with a non-empty input; the response follows it directly."""
INSTRUCTION_TEMPLATE_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"
"""Prompt of an instruction row whose input is empty or has no column (``input_column=None``)."""


@dataclass(frozen=True, kw_only=True)
class FormatSpec:
    """How rows of one dataset become samples."""

    kind: str = "text"
    """One of :data:`FORMATS`."""
    text_column: str = "text"
    """Column of a ``text`` row."""
    instruction_column: str = "instruction"
    """Column of an ``instruction`` row's instruction."""
    input_column: str | None = "input"
    """Column of an ``instruction`` row's optional input; ``None`` when the dataset has none (a row without the
    default ``input`` column has none either; a column named otherwise must be there)."""
    output_column: str = "output"
    """Column of an ``instruction`` row's response."""
    messages_column: str = "messages"
    """Column of a ``chat`` row's list of ``{"role", "content"}`` messages."""
    chat_template: str | None = None
    """A Jinja chat template used instead of the tokenizer's own."""
    train_on_prompt: bool = False
    """Train on every token, prompts and non-assistant turns included."""
    add_bos: bool = False
    """Prepend the tokenizer's BOS token to ``text`` and ``instruction`` samples."""
    ignore_index: int = -100
    """Label of a token that is not trained on."""
    source: str = "data.datasets[i]"
    """The source's config key, for the fix an error names (``data.datasets[0].output_column``)."""
    chat_view: Callable[..., Any] | None = None
    """How a second model with its own tokenizer and chat template reads each chat sample (a teacher of another
    tokenizer: :class:`kdsweep.teacher.views.TeacherViews`), called with the messages, the student's
    :class:`~kdsweep.data.chat.Rendering`, its token ids and the row's name; what it returns is kept with the sample
    (:attr:`Sample.view`)."""

    def __post_init__(self) -> None:
        if self.kind not in FORMATS:
            raise ConfigError(f"unknown data format {self.kind!r}; use one of {', '.join(FORMATS)}")

    @classmethod
    def of(cls, ds: DatasetConfig, source: str, **settings: Any) -> "FormatSpec":
        """The spec of source ``ds`` (config key ``source``); ``settings`` are the run-wide ones (template,
        ``train_on_prompt``, ``add_bos``, ``ignore_index``)."""
        return cls(kind=ds.format, text_column=ds.text_column, instruction_column=ds.instruction_column,
                   input_column=ds.input_column, output_column=ds.output_column, messages_column=ds.messages_column,
                   source=source, **settings)


@dataclass(frozen=True)
class Sample:
    """One rendered row: ``input_ids`` and shifted ``labels`` of equal length."""

    input_ids: list[int]
    labels: list[int]
    view: Any = None
    """A second model's reading of the sample (:attr:`FormatSpec.chat_view`), over its whole token list."""

    def __len__(self) -> int:
        return len(self.input_ids)


def shift(tokens: Sequence[int], trained: Sequence[bool], ignore_index: int = -100, view: Any = None) -> Sample:
    """The sample of full token list ``tokens`` where ``trained[i]`` says whether ``tokens[i]`` is a target."""
    labels = [t if keep else ignore_index for t, keep in zip(tokens[1:], trained[1:])]
    return Sample(list(tokens[:-1]), labels, view)


def render(row: Mapping[str, Any], spec: FormatSpec, tokenizer: Any, where: str = "row") -> Sample:
    """The sample of one row; ``where`` names the row in errors (e.g. ``"train.jsonl row 3"``)."""
    view = None
    if spec.kind == "chat":
        tokens, trained, view = _chat(row, spec, tokenizer, where)
    else:
        if spec.kind == "text":
            pieces = [(_column(row, spec.text_column, f"{spec.source}.text_column", where), True)]
        else:
            pieces = _instruction(row, spec, where)
        tokens, trained = [], []
        if spec.add_bos:
            tokens, trained = [_special(tokenizer, "bos", "set data.add_bos=false")], [False]
        for text, is_target in pieces:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            tokens += ids
            trained += [is_target] * len(ids)
        tokens.append(_special(tokenizer, "eos", "save the tokenizer with an eos_token"))
        trained.append(True)
    if spec.train_on_prompt:
        trained = [True] * len(tokens)
    return shift(tokens, trained, spec.ignore_index, view)


def check_row(row: Mapping[str, Any], spec: FormatSpec, where: str = "row") -> None:
    """The checks of :func:`render` that need no tokenizer: the row has the format's columns, of the right types."""
    if spec.kind == "chat":
        _messages(row, spec, where)
    elif spec.kind == "instruction":
        _instruction(row, spec, where)
    else:
        _column(row, spec.text_column, f"{spec.source}.text_column", where)


def chat_template(value: str | None) -> str | None:
    """``data.chat_template``: a Jinja template, or the path of a ``.jinja`` file holding one."""
    if value is None or not value.endswith(".jinja"):
        return value
    if not Path(value).is_file():
        raise ConfigError(f"data.chat_template={value} does not exist; pass a .jinja file or the template itself")
    return Path(value).read_text(encoding="utf-8")


def _column(row: Mapping[str, Any], column: str | None, field: str, where: str) -> str:
    if column not in row:
        have = ", ".join(map(str, row)) or "none"
        raise ConfigError(f"{where}: no column {column!r} (columns: {have}); set {field} to the right column")
    value = row[column]
    if not isinstance(value, str):
        raise ConfigError(f"{where}: column {column!r} holds {type(value).__name__}, not text; fix the data or {field}")
    return value


def _instruction(row: Mapping[str, Any], spec: FormatSpec, where: str) -> list[tuple[str, bool]]:
    instruction = _column(row, spec.instruction_column, f"{spec.source}.instruction_column", where)
    absent = spec.input_column is None or (spec.input_column == "input" and "input" not in row)  # the default's
    given = "" if absent else _column(row, spec.input_column, f"{spec.source}.input_column", where)
    if given.strip():
        prompt = INSTRUCTION_TEMPLATE.format(instruction=instruction, input=given)
    else:
        prompt = INSTRUCTION_TEMPLATE_NO_INPUT.format(instruction=instruction)
    return [(prompt, False), (_column(row, spec.output_column, f"{spec.source}.output_column", where), True)]


SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool", "function_call": "assistant", "observation": "tool"}
"""ShareGPT's ``from`` names and the roles a chat template knows them by (``function_call``/``observation``: the
tool-calling variant's assistant call and the tool's answer)."""


def _special(tokenizer: Any, name: str, fix: str) -> int:
    token_id = getattr(tokenizer, f"{name}_token_id")
    if token_id is None:
        raise ConfigError(f"the tokenizer has no {name.upper()} token; {fix}")
    return token_id


def _sharegpt(m: Mapping[str, Any], i: int, where: str) -> Mapping[str, Any]:
    """A ShareGPT message (``{"from": "human" | "gpt" | …, "value": …}``) as ``{"role", "content"}``
    (:data:`SHAREGPT_ROLES`); any other message as it is."""
    if not (isinstance(m, Mapping) and "from" in m and "value" in m and "role" not in m):
        return m
    if m["from"] not in SHAREGPT_ROLES:
        raise ConfigError(f"{where}: message {i} is from {m['from']!r}, which is not one of ShareGPT's roles "
                          f"({', '.join(SHAREGPT_ROLES)}); fix the row or write it as {{'role', 'content'}}")
    rest = {k: v for k, v in m.items() if k not in ("from", "value")}
    return {**rest, "role": SHAREGPT_ROLES[m["from"]], "content": m["value"]}


def _messages(row: Mapping[str, Any], spec: FormatSpec, where: str) -> list[dict[str, str]]:
    messages = row.get(spec.messages_column)
    if not isinstance(messages, (list, tuple)) or not messages:
        got = "nothing" if messages is None else f"{type(messages).__name__} {str(messages)[:40]!r}"
        other = next((c for c in ("conversations", "messages") if c != spec.messages_column and c in row), None)
        fix = f"set {spec.source}.messages_column" + (f"={other} (the row has it)" if other else "")
        raise ConfigError(
            f"{where}: a chat row needs a non-empty list of messages in column {spec.messages_column!r}, got {got}; "
            f"fix the row or {fix}"
        )
    messages = [_sharegpt(m, i, where) for i, m in enumerate(messages)]
    for i, m in enumerate(messages):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ConfigError(f"{where}: message {i} is {str(m)[:60]!r}, not {{'role': str, 'content': str}} (or "
                              "ShareGPT's {'from': str, 'value': str}); fix the row")
    return [dict(m) for m in messages]


def _chat(row: Mapping[str, Any], spec: FormatSpec, tokenizer: Any, where: str) -> tuple[list[int], list[bool], Any]:
    template = spec.chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ConfigError(
            f"{spec.source}: format 'chat' needs a chat template and tokenizer {name!r} has none; set "
            "data.chat_template or use format 'instruction'"
        )
    messages = _messages(row, spec, where)

    def text(conversation: list[dict[str, Any]], prompt: bool = False) -> str:
        try:
            return tokenizer.apply_chat_template(
                conversation, chat_template=template, tokenize=False, add_generation_prompt=prompt
            )
        except Exception as e:  # noqa: BLE001 - jinja errors, and templates that raise_exception() on a row
            if not conversation:  # templates that index messages[0] cannot render an empty conversation
                return ""
            message = " ".join(str(e).split())[:200]
            raise ConfigError(f"{where}: the chat template fails on this row ({type(e).__name__}: {message}); "
                              "fix the row or set data.chat_template") from None

    rendering = assistant_spans(messages, text, where)
    enc = tokenizer(rendering.full, add_special_tokens=False, return_offsets_mapping=True)
    # a token that overlaps a turn is trained on: byte-level BPE merges the space that ends a generation prompt
    # ("assistant: ") into the reply's first word, which must still be learnt (as {% generation %} masks do)
    trained = [any(s < b and e > a for a, b in rendering.spans) for s, e in enc["offset_mapping"]]
    ids = list(enc["input_ids"])
    view = None if spec.chat_view is None else spec.chat_view(messages, rendering, ids, where)
    return ids, trained, view
