"""A chat sample as a teacher with its own tokenizer reads it: in its own chat template, aligned on the contents.

The student's row holds its own template's text (its role headers, its end-of-turn tokens, Qwen3's ``<think>``
block); a teacher of another family is served in another template. So each chat sample is rendered twice when its
rows are built (:class:`TeacherViews`, the data's :attr:`~kdsweep.data.formats.FormatSpec.chat_view`): by the
student's template, as it trains, and by the teacher's (``teacher.chat_template``, or its tokenizer's own), as the
teacher is served. Both token sequences are placed on the one text the two models share: each assistant turn's
content (where :func:`~kdsweep.data.chat.assistant_spans` found it in each rendering), then one character for the
turn's end, which the first token each template writes after the content (``<|im_end|>``, ``<|eot_id|>``) covers.
Template text is never aligned with the other side's; user turns and system prompts are the teacher's context,
read in its own format. Places are bytes of each rendering, from the tokens' pieces, so a tokenizer that does not
spell its rendering back (lossy normalisation) is refused in one line, naming the row.

At a step, :class:`ViewReads` turns a batch's rows back into :class:`~kdsweep.teacher.reader.Read` s from their
views (kept beside the rows: :class:`~kdsweep.data.views.ViewTable`): packed documents apart, a truncated sample's
teacher tokens cut where the student's tokens end.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Callable, Sequence

from kdsweep.config.schema import ConfigError
from kdsweep.data.batch import Batch
from kdsweep.data.chat import Rendering, assistant_spans
from kdsweep.data.views import View, ViewTable
from kdsweep.teacher.align import Offset
from kdsweep.teacher.reader import KEEP_THE_TEXT, Read, text_changed, vocab_bytes

VIEWS_VERSION = 1
"""Bump when the views made from the same inputs change, so rows kept with old ones are not reused."""
TURN_END = "\ue002"
"""The character a turn's end stands for in a view's text (outside the bytes' latin-1 range: never content)."""


def token_bytes(tokenizer: Any) -> list[bytes]:
    """Per token id, the bytes it writes in a rendering: its piece's, or a special token's own text."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return [p.encode() if e is None else e[0] for p, e in zip(pieces, vocab_bytes(tokenizer))]


def placed(ids: Sequence[int], pieces: Sequence[bytes], special: set[int], text: str, where: str) -> list[Offset]:
    """Each token's ``[start, end)`` bytes in ``text`` (None: it writes nothing there), walking its pieces; one line
    (naming ``where``) when they do not spell ``text`` back. A SentencePiece-style piece may carry a space the text
    has not, at the text's start or after a special token (its prefix space): it covers the rest."""
    data, at, out = text.encode("utf-8"), 0, []
    for k, i in enumerate(ids):
        p = pieces[i]
        if data.startswith(p, at):
            out.append((at, at + len(p)) if p else None)
            at += len(p)
        elif p.startswith(b" ") and data.startswith(p[1:], at) and (k == 0 or ids[k - 1] in special):
            out.append((at, at + len(p) - 1) if len(p) > 1 else None)
            at += len(p) - 1
        else:
            raise text_changed(where, data[at:at + 60].decode("utf-8", "replace"),
                               b"".join(pieces[j] for j in ids[k:k + 12]).decode("utf-8", "replace"))
    if at != len(data):
        raise ConfigError(f"{where}: its tokens end before the rendered text does; {KEEP_THE_TEXT}")
    return out


def on_contents(rendering: Rendering, places: Sequence[Offset], shared: Sequence[bool]) -> tuple[str, list[Offset]]:
    """The view's text (each assistant turn's content as one character per byte, then :data:`TURN_END`) and each
    token's place in it: a token over a turn's content, clipped to it; the first token of what the template writes
    after the content (as far as the turn trains; not the content's own trailing whitespace), its turn's end; else
    None. ``shared[k]``: turn k's content is the same on both sides (else only its end is aligned)."""
    full = rendering.full
    data = full.encode("utf-8")
    at = lambda char: len(full[:char].encode("utf-8"))
    text, turns = [], []  # per turn: content bytes [cs, ce), closing bytes [ce, close), its place in the text
    for (cs, ce), (_, end), same in zip(rendering.contents, rendering.spans, shared):
        cs_b, ce_b = (at(cs), at(ce)) if same else (at(ce), at(ce))
        base = len(text)
        text.extend(chr(b) for b in data[cs_b:ce_b])
        text.append(TURN_END)
        turns.append((cs_b, ce_b, at(max(end, ce)), base))
    out: list[Offset] = []
    ended = set()
    for o in places:
        place = None
        for k, (cs_b, ce_b, close_b, base) in enumerate(turns):
            if o is None:
                break
            a, b = o
            if max(a, cs_b) < min(b, ce_b):  # over the content (an empty one, not shared, has none over it)
                place = (max(a, cs_b) - cs_b + base, min(b, ce_b) - cs_b + base)
                break
            if ce_b <= a < close_b and k not in ended and data[a:b].strip():  # not the content's trailing space
                ended.add(k)
                end = base + ce_b - cs_b
                place = (end, end + 1)
                break
        out.append(place)
    return "".join(text), out


class TeacherViews:
    """A :class:`~kdsweep.data.dataset.ChatView`: each chat sample in the teacher's own template, both sides placed on
    their shared contents (the module docstring)."""

    def __init__(self, student: Any, teacher: Any, template: str, section: str = "teacher") -> None:
        self.student, self.teacher, self.template, self.section = student, teacher, template, section
        self.s_special, self.t_special = set(student.all_special_ids), set(teacher.all_special_ids)
        backend = getattr(teacher, "backend_tokenizer", None)
        spec = backend.to_str() if backend is not None else repr(sorted(teacher.get_vocab().items()))
        self.identity = hashlib.sha256(
            repr((VIEWS_VERSION, spec, template, sorted(self.t_special))).encode()).hexdigest()[:16]
        """The teacher's tokenizer (vocabulary, normaliser, special tokens) and template: what its views depend on."""

    @functools.cached_property
    def pieces(self) -> tuple[list[bytes], list[bytes]]:
        """The student's and the teacher's :func:`token_bytes`, made when the first sample is read (a job whose rows
        are cached needs only :attr:`identity`)."""
        return token_bytes(self.student), token_bytes(self.teacher)

    def _render(self, where: str) -> Callable[..., str]:
        def render(conversation: list[dict[str, Any]], prompt: bool = False) -> str:
            try:
                return self.teacher.apply_chat_template(conversation, chat_template=self.template, tokenize=False,
                                                        add_generation_prompt=prompt)
            except Exception as e:  # noqa: BLE001 - jinja errors, and templates that raise_exception() on a row
                if not conversation:
                    return ""
                message = " ".join(str(e).split())[:200]
                raise ConfigError(f"{where}: the teacher's chat template fails on this row ({type(e).__name__}: "
                                  f"{message}); fix the row or set {self.section}.chat_template") from None
        return render

    def __call__(self, messages: list[dict[str, Any]], rendering: Rendering, ids: list[int], where: str) -> View:
        theirs = assistant_spans(messages, self._render(where), f"{where} (the teacher's chat template)",
                                 fix=f"{self.section}.chat_template")
        t_ids = list(self.teacher(theirs.full, add_special_tokens=False)["input_ids"])
        s_pieces, t_pieces = self.pieces
        s_places = placed(ids, s_pieces, self.s_special, rendering.full, f"model ({where})")
        t_places = placed(t_ids, t_pieces, self.t_special, theirs.full, f"{self.section} ({where})")
        shared = [rendering.full[a:b] == theirs.full[c:d]
                  for (a, b), (c, d) in zip(rendering.contents, theirs.contents)]
        text, student = on_contents(rendering, s_places, shared)
        text_t, teacher = on_contents(theirs, t_places, shared)
        assert text == text_t, (text, text_t)  # the same contents, by construction
        return View(text, student, t_ids, teacher)


def _documents(batch: Batch, r: int, count: int) -> list[tuple[int, int]]:
    """``[start, end)`` positions of row r's first ``count`` documents (the rest is padding)."""
    if batch.position_ids is not None:
        starts = [k for k, p in enumerate(batch.position_ids[r].tolist()) if p == 0][: count + 1]
        ends = starts[1:] + [batch.input_ids.shape[1]]
        return list(zip(starts, ends))[:count]
    n = batch.input_ids.shape[1] if batch.attention_mask is None else int(batch.attention_mask[r].sum())
    return [(0, n)]


def read_views(views: Sequence[View], ids: list[int], labels: list[int], documents: Sequence[tuple[int, int]],
               ignore_index: int) -> Read:
    """One row as the teacher reads it, from its documents' views (positions ``documents``, in the row's order)."""
    text, student, seq, predictor = "", [], [], []
    t_ids, t_off, t_pos = [], [], []
    for view, (p0, p1) in zip(views, documents):
        base = len(text)
        tokens = ids[p0:p1] + ([labels[p1 - 1]] if labels[p1 - 1] != ignore_index else [])
        shift = lambda o: None if o is None else (o[0] + base, o[1] + base)
        places = [shift(o) for o in view.student[: len(tokens)]]
        seq += tokens
        predictor += [None] + list(range(p0, p0 + len(tokens) - 1))
        student += places
        covered = max((o[1] for o in places if o is not None), default=base)
        for j, (i, o) in enumerate(zip(view.teacher_ids, view.teacher)):  # cut where the student's tokens end
            o = shift(o)
            if o is not None and o[0] >= covered:
                break
            t_ids.append(i)
            t_off.append(o)
            t_pos.append(j)  # each document's teacher positions from 0, as the student's
        text += view.text
    return Read(text, student, t_ids, t_off, t_pos, seq, predictor)


class ViewReads:
    """Reads a batch's rows from the views kept beside them (:meth:`read_batch`, as
    :meth:`~kdsweep.teacher.reader.RowReader.read_batch` does from the student's tokens)."""

    def __init__(self, views: dict[str, ViewTable]) -> None:
        self.views = views
        """Per split (train, eval), its rows' views."""

    def read_batch(self, batch: Batch, split: str, ignore_index: int) -> list[Read]:
        if batch.rows is None:
            raise ValueError("chat rows read in the teacher's own template need batches made by Rows.batch")
        table, ids, labels = self.views[split], batch.input_ids.tolist(), batch.labels.tolist()
        reads = []
        for r, row in enumerate(batch.rows.tolist()):
            views = table.row(row)
            reads.append(read_views(views, ids[r], labels[r], _documents(batch, r, len(views)), ignore_index))
        return reads


def reads_chat_in_own_template(cfg: Any) -> bool:
    """Whether the run's teacher reads chat samples in its own template: it has another tokenizer than the
    student's (one teacher: several are refused with chat), and the data has chat sources."""
    from kdsweep.models.check import cross_tokenizer

    chat = any(ds.format == "chat" for ds in (*cfg.data.datasets, *cfg.data.eval_datasets))
    return chat and not cfg.teachers and cross_tokenizer(cfg)


def chat_view(cfg: Any, student: Any = None, teacher: Callable[[], Any] | None = None) -> TeacherViews | None:
    """How the run's teacher reads its chat samples: in its own template when its tokenizer is not the student's
    (None: the same tokenizer, several teachers, or no chat data). ``student``: its tokenizer, and ``teacher()``
    loads the teacher's (default: each from its model's directory). One line for a teacher with no template."""
    from kdsweep.data.formats import chat_template
    from kdsweep.models.load import load_tokenizer, resolve_dir

    if not reads_chat_in_own_template(cfg):
        return None
    tokenizer = teacher() if teacher is not None else load_tokenizer(resolve_dir(cfg.teacher, "teacher"))
    template = chat_template(cfg.teacher.chat_template) or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ConfigError("teacher: chat data needs the teacher's own chat template, and its tokenizer has none; set "
                          "teacher.chat_template (a template, or a .jinja file)")
    return TeacherViews(student if student is not None else load_tokenizer(resolve_dir(cfg.model)), tokenizer, template)


__all__ = ["TURN_END", "TeacherViews", "ViewReads", "chat_view", "on_contents", "placed", "read_views",
           "reads_chat_in_own_template", "token_bytes"]
