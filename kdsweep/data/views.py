"""A second model's reading of each sample, kept with the rows: what a teacher with its own tokenizer and chat
template needs to read a chat row in its own format (kdsweep.teacher.views makes and reads them).

A :class:`View` is one sample: the text both models read (each assistant turn's content, then one character for
the turn's end), the sample's tokens' places in that text, and the second model's tokens of its own rendering of
the same messages with their places. A split's views are stored flat beside its rows (``<split>.views.pt``), so
every rank memory-maps one file: :class:`ViewTable`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from kdsweep.data import integrity

Offset = tuple[int, int]


@dataclass(frozen=True)
class View:
    """One sample as two models read it. Offsets are ``[start, end)`` places in ``text`` (None: the token is template
    text, which is never aligned with the other model's)."""

    text: str
    """What both read: each assistant turn's content, one character per byte (latin-1), then one marker character
    for the turn's end (the convention of :class:`kdsweep.teacher.reader.Read`)."""
    student: list[Offset | None]
    """One per token of the sample's whole token list (its inputs, then its last target)."""
    teacher_ids: list[int]
    """The second model's tokens of its own rendering of the sample."""
    teacher: list[Offset | None]


def _places(offsets: Sequence[Offset | None]) -> list[list[int]]:
    return [[-1, -1] if o is None else [o[0], o[1]] for o in offsets]


class ViewTable:
    """The views of a split's rows (each row: its documents' views in order), as flat tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.t = tensors

    @classmethod
    def of(cls, rows: Sequence[Sequence[View]]) -> "ViewTable":
        docs = [v for row in rows for v in row]
        texts = [v.text.encode("utf-8") for v in docs]
        at = lambda sizes: torch.tensor([0, *sizes], dtype=torch.int64).cumsum(0)
        pairs = lambda xs: torch.tensor(xs, dtype=torch.int32).reshape(-1, 2)
        return cls({
            "row_docs": at([len(row) for row in rows]),
            "text": torch.tensor(list(b"".join(texts)), dtype=torch.uint8), "text_at": at(map(len, texts)),
            "student": pairs([p for v in docs for p in _places(v.student)]),
            "student_at": at(len(v.student) for v in docs),
            "teacher_ids": torch.tensor([i for v in docs for i in v.teacher_ids], dtype=torch.int32),
            "teacher": pairs([p for v in docs for p in _places(v.teacher)]),
            "teacher_at": at(len(v.teacher) for v in docs),
        })

    def __len__(self) -> int:
        return len(self.t["row_docs"]) - 1

    def row(self, i: int) -> list[View]:
        """Row ``i``'s documents' views, in the row's order."""
        t = self.t
        out = []
        for d in range(int(t["row_docs"][i]), int(t["row_docs"][i + 1])):
            cut = lambda name: slice(int(t[f"{name}_at"][d]), int(t[f"{name}_at"][d + 1]))
            places = lambda name: [None if a < 0 else (a, b) for a, b in t[name][cut(name)].tolist()]
            out.append(View(bytes(t["text"][cut("text")].tolist()).decode("utf-8"), places("student"),
                            t["teacher_ids"][cut("teacher")].tolist(), places("teacher")))
        return out

    def head(self, n: int) -> "ViewTable":
        """The views of the first ``n`` rows."""
        return ViewTable({**self.t, "row_docs": self.t["row_docs"][: n + 1]})

    def save(self, path: Path) -> None:
        integrity.save(self.t, path)

    @classmethod
    def load(cls, path: Path) -> "ViewTable":
        return cls(integrity.load(path))


__all__ = ["View", "ViewTable"]
