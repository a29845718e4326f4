"""How a teacher with its own tokenizer reads a student's row: the row's text, and the teacher's tokens of it.

The student's tokens are turned back into the bytes they stand for (:func:`~kdsweep.teacher.align.piece_bytes`);
each run of content tokens between the student's special tokens (BOS, EOS, a document start in a packed row) is
one segment, which the teacher tokenizes in its own vocabulary and conventions; the student's BOS and EOS become
the teacher's own (and align with them: the student learns where a document ends from the teacher's EOS), other
special tokens are not aligned, and a packed row's documents stay apart (the teacher's positions restart with each, as
the student's do). Both sides' offsets are byte offsets into the row's bytes, so that a byte-level token holding part of
a character still has a place; :func:`~kdsweep.teacher.align.align_spans` reads them as one character per byte (``text``
is the bytes decoded as latin-1). Bytes that are not valid UTF-8 (a character cut at the row's edge) are not given to
the teacher: the student tokens over them stay unaligned. A segment whose teacher tokens do not spell it back (the
teacher's normalisation changed the text: lowercasing, an unknown character) is not aligned either: its bytes are
:attr:`Read.changed`, the teacher reads them as context, and the job refuses a teacher that changes the first rows it
reads (:func:`kdsweep.teacher.job.check_reads`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kdsweep.config.schema import ConfigError
from kdsweep.teacher.align import Offset, byte_level, piece_bytes


def is_byte_level(tokenizer: Any) -> bool | None:
    """True for byte-level BPE (``Ġ``), False for SentencePiece-style pieces (``▁``, byte fallback), None for a
    convention kdsweep cannot read back into bytes (WordPiece's ``##``, a word list, a slow tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return None if backend is None else byte_level(json.loads(backend.to_str()))


def vocab_bytes(tokenizer: Any) -> list[tuple[bytes, bool] | None]:
    """Per token id, the bytes it stands for and whether it is a byte-fallback token; None for a special token."""
    special, level = set(tokenizer.all_special_ids), bool(is_byte_level(tokenizer))
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return [None if i in special else piece_bytes(p, level) for i, p in enumerate(pieces)]


KEEP_THE_TEXT = "use a teacher whose tokenizer keeps the text, or one with the student's tokenizer"
"""The fix a refusal of a teacher whose reading changes the text names."""


def text_changed(where: str, seen: str, spelled: str) -> ConfigError:
    """The one line for a tokenizer whose tokens of ``seen`` spell ``spelled`` (``where``: whose, or which row)."""
    seen, spelled = (" ".join(t.split())[:60] for t in (seen, spelled))
    return ConfigError(f"{where}: its tokenizer does not give the data's text back as it is (it reads {seen!r} as "
                       f"{spelled!r}: its normalisation changes the text); {KEEP_THE_TEXT}")


def check_unchanged(read: "Read", where: str) -> None:
    """One line when the teacher's tokens of ``read`` spell its text otherwise (``where``: the teacher's key)."""
    if read.changed is not None:
        raise text_changed(where, *read.changed)


MARKERS = ("\ue000", "\ue001")
"""The characters a BOS and an EOS stand for in a row's text (outside the bytes' latin-1 range: never content)."""


@dataclass
class Read:
    """One student row as the teacher reads it (offsets are bytes of ``text``). The student's side is its sequence
    of tokens, inputs and the targets that are not inputs, each with the position that predicts it (None: none)."""

    text: str
    student: list[Offset]
    teacher_ids: list[int]
    teacher: list[Offset]
    teacher_positions: list[int] = field(default_factory=list)
    student_ids: list[int] = field(default_factory=list)
    predictor: list[int | None] = field(default_factory=list)
    skipped: frozenset[int] = frozenset()
    """Bytes of ``text`` not aligned: the teacher was not given them (not valid UTF-8: a character the row's edge
    cut), or its tokens do not spell them (``changed``)."""
    changed: tuple[str, str] | None = None
    """The first segment the teacher's tokens spell otherwise, and how they spell it (None: none)."""


class RowReader:
    """Reads student rows for one (student tokenizer, teacher tokenizer) pair; built once per job."""

    def __init__(self, student: Any, teacher: Any, section: str = "teacher") -> None:
        s_level, self.t_level = is_byte_level(student), is_byte_level(teacher)
        for name, level, tok in (("model", s_level, student), (section, self.t_level, teacher)):
            if level is None:
                raise ConfigError(f"{name}: its tokenizer ({type(tok).__name__}) writes tokens in a convention kdsweep "
                                  "cannot map back to text (byte-level BPE and SentencePiece-style pieces can); "
                                  "use a teacher and student with fast BPE tokenizers")
        self.pieces = [None if e is None else e[0] for e in vocab_bytes(student)]
        self.s_bos, self.s_eos, self.s_pad = student.bos_token_id, student.eos_token_id, student.pad_token_id
        self.teacher = teacher
        self.t_bos, self.t_eos = teacher.bos_token_id, teacher.eos_token_id
        self.t_pieces = [b"" if e is None else e[0] for e in vocab_bytes(teacher)]

    def read_batch(self, batch: Any, split: str, ignore_index: int) -> list[Read]:
        """A micro-batch's rows, packed documents apart (``split`` does not matter: the rows' tokens are all it
        reads; :class:`kdsweep.teacher.views.ViewReads` reads chat rows from what was kept beside them)."""
        ids = batch.input_ids.tolist()
        starts = ([{k for k, p in enumerate(row) if p == 0} for row in batch.position_ids.tolist()]
                  if batch.position_ids is not None else [set()] * len(ids))
        return [self.read(row, labels, doc, ignore_index)
                for row, labels, doc in zip(ids, batch.labels.tolist(), starts)]

    def read(self, ids: list[int], labels: list[int] | None = None, doc_starts: set[int] = frozenset(),
             ignore_index: int = -100) -> Read:
        """``ids``: one student row; ``labels``: its targets (``labels[t]`` is what position t predicts);
        ``doc_starts``: the positions where a packed document begins (its position ids restart). A target that is not
        the next input (the EOS a packed document ends with, the token past the row's end) is part of the student's
        sequence too, predicted by its position, so that the teacher reads it and the spans hold it."""
        text, seq, student, predictor, seg_start = [], [], [], [], 0  # text: a character per byte, a marker per BOS/EOS
        skipped: set[int] = set()  # bytes not given to the teacher (not valid UTF-8: a character the row cut)
        changed: list[tuple[str, str]] = []  # segments the teacher's tokens spell otherwise
        t_ids, t_off, t_pos = [], [], []
        pos = 0

        def flush() -> None:
            nonlocal pos, seg_start
            segment = "".join(text[seg_start:]).encode("latin-1")
            for i, o in self._teacher_tokens(segment, seg_start, skipped, changed):
                t_ids.append(i)
                t_off.append(o)
                t_pos.append(pos)
                pos += 1
            seg_start = len(text)

        def add(token: int, by: int | None) -> bool:
            """The student's token ``token``, predicted by position ``by``; False at padding (the row's end)."""
            nonlocal seg_start, pos
            piece = self.pieces[token] if 0 <= token < len(self.pieces) else None
            if piece is not None:
                seq.append(token)
                predictor.append(by)
                student.append((len(text), len(text) + len(piece)))
                text.extend(chr(b) for b in piece)
                return True
            flush()
            if token == self.s_pad and token not in (self.s_bos, self.s_eos):
                return False
            # one token for both (GPT-2's <|endoftext|>): an end where a position predicts it, else a beginning
            ends = token == self.s_eos and (token != self.s_bos or by is not None)
            own = self.t_eos if ends else self.t_bos if token == self.s_bos else None
            seq.append(token)
            predictor.append(by)
            if own is None:  # a special token the teacher has no counterpart of: not aligned
                student.append(None)
            else:  # the student's BOS/EOS and the teacher's own cover one marker character: a span of their own
                marker = (len(text), len(text) + 1)
                text.append(MARKERS[ends])
                student.append(marker)
                t_ids.append(own)
                t_off.append(marker)
                t_pos.append(pos)
                pos += 1
                seg_start = len(text)
            return True

        last = len(ids) - 1
        for t, token in enumerate(ids):
            start = t in doc_starts and t > 0
            if start:
                flush()
                pos = 0
            shifted = t > 0 and not start and (labels is None or labels[t - 1] in (token, ignore_index))
            if not add(token, t - 1 if shifted else None):
                break
            target = None if labels is None else labels[t]
            if (target is not None and target != ignore_index
                    and (t == last or target != ids[t + 1] or t + 1 in doc_starts)):
                if not add(target, t):
                    break
        flush()
        return Read("".join(text), student, t_ids, t_off, t_pos, seq, predictor, frozenset(skipped),
                    changed[0] if changed else None)

    def _teacher_tokens(self, segment: bytes, base: int, skipped: set[int],
                        changed: list[tuple[str, str]]) -> list[tuple[int, Offset]]:
        """The teacher's tokens of ``segment`` (bytes at ``base`` of the row) with byte offsets; runs of bytes that are
        not valid UTF-8 are skipped (added to ``skipped``), and so are runs its tokens do not spell back (their
        tokens get no offsets; the run and its spelling are added to ``changed``). Special-token strings in the
        text are text."""
        out, at = [], 0
        while at < len(segment):
            try:
                chunk, end = segment[at:].decode("utf-8"), len(segment)
            except UnicodeDecodeError as e:
                chunk, end = segment[at:at + e.start].decode("utf-8"), at + e.end
                skipped.update(range(base + at + e.start, base + end))
            if chunk:
                enc = self.teacher(chunk, add_special_tokens=False, return_offsets_mapping=True,
                                   split_special_tokens=True)
                offsets = self._piece_offsets(enc["input_ids"], chunk.encode("utf-8"))
                if offsets is None:  # its normalisation changed the text: read as context, never aligned
                    offsets = [None] * len(enc["input_ids"])
                    skipped.update(range(base + at, base + at + len(chunk.encode("utf-8"))))
                    changed.append((chunk,
                                    b"".join(self.t_pieces[i] for i in enc["input_ids"]).decode("utf-8", "replace")))
                out += [(i, None if o is None else (base + at + o[0], base + at + o[1]))
                        for i, o in zip(enc["input_ids"], offsets)]
            at = end
        return out

    def _piece_offsets(self, ids: list[int], chunk: bytes) -> list[Offset] | None:
        """Exact byte offsets from the teacher's pieces, when they spell ``chunk`` (a SentencePiece-style tokenizer
        may put a space in front of it); None when its normalisation changed the text."""
        pieces = [self.t_pieces[i] for i in ids]
        spelled = b"".join(pieces)
        shift = 0 if spelled == chunk else 1 if spelled == b" " + chunk else None
        if shift is None:
            return None
        out, at = [], -shift
        for p in pieces:
            a, b = max(at, 0), at + len(p)
            out.append((a, b) if b > a else None)
            at = b
        return out


__all__ = ["KEEP_THE_TEXT", "Read", "RowReader", "check_unchanged", "is_byte_level", "text_changed", "vocab_bytes"]
