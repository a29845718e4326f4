"""Aligning two tokenizations of the same content: the student's tokens and a teacher's, by characters.

Both sides tokenize the same content (a document, a message) in their own format, and each side reports, per
token, the characters of the content it covers (a tokenizer's offset mapping, moved into one coordinate system
for both sides), or ``None`` for a token that is not content (BOS/EOS, special tokens, a template's own text).
:func:`align_spans` groups the content tokens of the two sides into **spans** that cover the same characters:
one student token to one teacher token, or several on either side (a teacher token covering two student tokens,
or the reverse). Tokens that are not content are never aligned with the other side's content.

Boundaries are compared after moving each token's end left over whitespace (``snap``), so leading-space
conventions agree: ``Ġword`` (byte-level BPE, the space in the token) and ``▁word`` (SentencePiece) end where
``word`` ends; a token made only of whitespace is a span of its own where the other side has the same whitespace
as a token (two equal tokenizations give one-token spans throughout), else it joins the span after it. Tokens that end
within what a span just closed holds (the second byte of a multi-byte character split into byte tokens, byte-fallback
tokens that each report the whole character) join that span too. A span that never closes (the sequence was cut inside
it) is left out, and so are the tokens after the last closed span: :attr:`Alignment.unaligned` counts them. A span never
closes where a token of either side crosses its boundary (a byte-level token holding the last byte of one character and
the first of the next): the two characters are one span then.

:func:`shared_vocab` pairs the tokens both vocabularies hold: the same bytes once each side's conventions are undone
(:func:`piece_bytes`: byte-level BPE's byte alphabet, SentencePiece's ``▁`` for a space and ``<0xAB>`` byte tokens).

Pure Python: no tokenizer, no torch.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

Offset = Optional[tuple[int, int]]
"""``(start, end)`` characters of the content a token covers, or None for a token that is not content."""


@dataclass(frozen=True)
class Span:
    """Student tokens ``[student[0], student[1])`` and teacher tokens ``[teacher[0], teacher[1])`` cover the same
    characters ``[chars[0], chars[1])`` (token indices into each side's sequence, content tokens only inside)."""

    student: tuple[int, int]
    teacher: tuple[int, int]
    chars: tuple[int, int]


@dataclass
class Alignment:
    spans: list[Span] = field(default_factory=list)
    unaligned: tuple[int, int] = (0, 0)
    """Content tokens (student, teacher) in no span: inside a span the sequence cut, or after the last one."""


SPACE = frozenset(" \t\n\r\f\v")
"""What counts as whitespace: ASCII's only (in byte coordinates, 0x85 and 0xA0 are parts of UTF-8 characters)."""


def snap(text: str, position: int) -> int:
    """``position`` moved left over whitespace: where the non-space content before it ends."""
    while position > 0 and text[position - 1] in SPACE:
        position -= 1
    return position


def _content(offsets: Sequence[Offset]) -> list[int]:
    return [i for i, o in enumerate(offsets) if o is not None]


def align_spans(text: str, student: Sequence[Offset], teacher: Sequence[Offset],
                ignore: frozenset[int] = frozenset()) -> Alignment:
    """The spans of ``student`` and ``teacher`` tokens that cover the same characters of ``text``.

    Each side's content tokens must be in order (starts never decrease); a side may skip characters the other
    covers only where they are whitespace. Raises a one-line ValueError when the two sides cover different
    non-space characters (one side's tokenizer changed the text: lossy normalisation); characters in ``ignore`` (that
    one side could not be given) do not count."""
    s_idx, t_idx = _content(student), _content(teacher)
    s_start, t_start = [student[k][0] for k in s_idx], [teacher[k][0] for k in t_idx]
    s_raw, t_raw = [student[k][1] for k in s_idx], [teacher[k][1] for k in t_idx]
    s_end, t_end = [snap(text, e) for e in s_raw], [snap(text, e) for e in t_raw]
    ns, nt = len(s_idx), len(t_idx)
    spans: list[Span] = []
    i = j = 0  # next content token of each side
    closed = -1  # where the last span ended (whitespace stripped)
    while i < ns and j < nt:
        i0, j0 = i, j
        si, tj, s_far, t_far = s_end[i], t_end[j], s_raw[i], t_raw[j]
        i, j = i + 1, j + 1

        def grow(student_side: bool) -> None:
            nonlocal si, s_far, i, tj, t_far, j
            if student_side:
                si, s_far, i = max(si, s_end[i]), max(s_far, s_raw[i]), i + 1
            else:
                tj, t_far, j = max(tj, t_end[j]), max(t_far, t_raw[j]), j + 1

        def grow_behind(s_key: int, t_key: int) -> bool:
            """Grow the side whose key is behind the other's; False when that side has no token left."""
            side = s_key < t_key
            if (i < ns) if side else (j < nt):
                grow(side)
                return True
            return False

        while True:
            while si != tj and grow_behind(si, tj):  # until both end at one boundary
                pass
            if si != tj:
                break
            if si == closed and s_far != t_far:  # whitespace only, and not the same whitespace: go on
                if not grow_behind(s_far, t_far):
                    break
                continue
            while i < ns and s_raw[i] <= s_far:  # tokens within what the span holds (bytes of one character)
                i += 1
            while j < nt and t_raw[j] <= t_far:
                j += 1
            straddles = (i < ns and s_start[i] < si, j < nt and t_start[j] < si)  # a byte token across it
            if not any(straddles):
                break
            for side, straddling in zip((True, False), straddles):
                if straddling:
                    grow(side)
        if si != tj:  # the sequence ends inside this span: it never closes
            i, j = i0, j0
            break
        start = min(s_start[i0], t_start[j0])
        spans.append(Span((s_idx[i0], s_idx[i - 1] + 1), (t_idx[j0], t_idx[j - 1] + 1), (start, si)))
        closed = si
    _check_same_text(text, student, teacher, s_idx[:i], t_idx[:j], ignore)
    return Alignment(spans, (len(s_idx) - i, len(t_idx) - j))


def _check_same_text(text: str, student: Sequence[Offset], teacher: Sequence[Offset], s_idx: list[int],
                     t_idx: list[int], ignore: frozenset[int]) -> None:
    """The aligned tokens of both sides cover the same non-space characters."""
    def covered(offsets: Sequence[Offset], idx: list[int]) -> set[int]:
        return {c for i in idx for c in range(*offsets[i]) if text[c] not in SPACE and c not in ignore}

    only_s = covered(student, s_idx) - covered(teacher, t_idx)
    only_t = covered(teacher, t_idx) - covered(student, s_idx)
    if only_s or only_t:
        where = min(only_s | only_t)
        raise ValueError("the two tokenizations cover different characters near "
                         f"{text[max(0, where - 10):where + 10]!r} (character {where}): one tokenizer does not give "
                         "the text back as it is")


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table), inverted: character → byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_in, extra = {}, 0
    for b in range(256):
        if b in kept:
            stand_in[b] = chr(b)
        else:
            stand_in[b], extra = chr(256 + extra), extra + 1
    return {c: b for b, c in stand_in.items()}


def byte_level(tokenizer_json: dict) -> bool | None:
    """From a tokenizer.json: True for byte-level BPE (``Ġ``), False for SentencePiece-style pieces (``▁``, byte
    fallback), None for a convention whose pieces cannot be read back into bytes (WordPiece's ``##``, a word list)."""
    kinds = json.dumps([tokenizer_json.get("decoder"), tokenizer_json.get("pre_tokenizer")])
    if "ByteLevel" in kinds:
        return True
    if "Metaspace" in kinds or "ByteFallback" in kinds or "\\u2581" in kinds:  # ▁, as json.dumps writes it
        return False
    return None


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def piece_bytes(piece: str, byte_level: bool) -> tuple[bytes, bool]:
    """The bytes a vocabulary entry stands for, and whether it is a byte-fallback token (``<0xAB>``).

    ``byte_level``: the entry is written in byte-level BPE's alphabet (``Ġ`` for a space). Otherwise ``▁`` is a
    space (SentencePiece, Metaspace) and the rest is UTF-8 text."""
    if byte_level:
        alphabet = _byte_level_alphabet()
        if all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece), False
        return piece.encode(), False
    match = _BYTE_TOKEN.fullmatch(piece)
    if match:
        return bytes([int(match[1], 16)]), True
    return piece.replace("\u2581", " ").encode(), False


def shared_vocab(student: Iterable[tuple[int, bytes, bool]],
                 teacher: Iterable[tuple[int, bytes, bool]]) -> list[tuple[int, int]]:
    """``(student id, teacher id)`` for every byte string both vocabularies hold; entries are ``(id, bytes,
    byte_fallback)`` without special tokens. Where a side holds one string twice (a byte token and a plain one),
    its plain entry, then its lowest id, is the one paired."""
    def first_of(entries: Iterable[tuple[int, bytes, bool]]) -> dict[bytes, int]:
        chosen: dict[bytes, int] = {}
        for i, text, fallback in sorted(entries, key=lambda e: (e[2], e[0])):
            chosen.setdefault(text, i)
        return chosen

    s, t = first_of(student), first_of(teacher)
    return sorted((i, t[text]) for text, i in s.items() if text in t)


__all__ = ["Alignment", "Offset", "Span", "align_spans", "byte_level", "piece_bytes", "shared_vocab", "snap"]
