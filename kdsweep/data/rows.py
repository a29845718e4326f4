"""The rows a run trains or evaluates on, stored flat so one file per split can be memory-mapped by every rank.

A split is four int tensors: ``input_ids`` and ``labels`` of all rows end to end, ``offsets`` (row ``i`` is
``offsets[i]:offsets[i+1]``) and ``tokens`` (each row's non-padding tokens), plus ``position_ids`` for packed
rows. Streamed and packed rows all have ``seq_len`` tokens; padded rows (one sample each) have their own length
and are padded when a micro-batch is formed. Rows whose samples carry a second model's reading
(kdsweep.data.views) keep it in ``<split>.views.pt`` beside them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from kdsweep.data import integrity
from kdsweep.data.batch import Batch
from kdsweep.data.views import View, ViewTable

FIELDS = ("input_ids", "labels", "offsets", "tokens", "position_ids")


@dataclass(frozen=True)
class Rows:
    input_ids: torch.Tensor
    labels: torch.Tensor
    offsets: torch.Tensor
    tokens: torch.Tensor
    position_ids: torch.Tensor | None
    pad_id: int
    ignore_index: int
    views: ViewTable | None = None
    """Per row, a second model's reading of its samples (kdsweep.data.views; None: no sample has one)."""

    @classmethod
    def from_rows(cls, input_ids: Sequence[Sequence[int]] | torch.Tensor,
                  labels: Sequence[Sequence[int]] | torch.Tensor,
                  position_ids: Sequence[Sequence[int]] | torch.Tensor | None, tokens: Sequence[int] | torch.Tensor,
                  *, pad_id: int, ignore_index: int, views: Sequence[Sequence[View]] | None = None) -> "Rows":
        """From lists of rows of any lengths, or ``[N, T]`` tensors of equal-length rows; ``views``: each row's
        samples' views."""
        def flat(rows: Any) -> torch.Tensor:
            if isinstance(rows, torch.Tensor):
                return rows.reshape(-1).to(torch.int32)
            return torch.tensor([t for r in rows for t in r], dtype=torch.int32)

        lengths = ([input_ids.shape[1]] * len(input_ids) if isinstance(input_ids, torch.Tensor)
                   else list(map(len, input_ids)))
        offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
        return cls(flat(input_ids), flat(labels), offsets, torch.as_tensor(tokens, dtype=torch.int64),
                   None if position_ids is None else flat(position_ids), pad_id, ignore_index,
                   None if views is None else ViewTable.of(views))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets.diff()

    def save(self, path: Path) -> None:
        tensors = {k: getattr(self, k) for k in FIELDS if getattr(self, k) is not None}
        integrity.save({**tensors, "pad_id": self.pad_id, "ignore_index": self.ignore_index}, path)
        if self.views is not None:
            self.views.save(path.with_suffix(".views.pt"))

    @classmethod
    def load(cls, path: Path) -> "Rows":
        """Memory-mapped: pages are read when rows are used, and shared by every process that maps the file;
        checked against its checksums first (:func:`kdsweep.data.integrity.load`)."""
        d = integrity.load(path)
        views = path.with_suffix(".views.pt")
        return cls(*(d.get(k) for k in FIELDS), pad_id=d["pad_id"], ignore_index=d["ignore_index"],
                   views=ViewTable.load(views) if views.is_file() else None)

    def head(self, n: int) -> "Rows":
        """The first ``n`` rows (all when ``n`` is 0 or larger than the split)."""
        if not n or n >= len(self):
            return self
        end = int(self.offsets[n])
        cut = lambda t: None if t is None else t[:end]
        return Rows(cut(self.input_ids), cut(self.labels), self.offsets[: n + 1], self.tokens[:n],
                    cut(self.position_ids), self.pad_id, self.ignore_index,
                    None if self.views is None else self.views.head(n))

    def batch(self, indices: Sequence[int] | torch.Tensor, *, mask_labels: bool = False) -> Batch:
        """Rows ``indices`` as one micro-batch, right-padded to the longest with an attention mask when their
        lengths differ; ``mask_labels`` ignores every label (a batch that only keeps ranks in step)."""
        spans = [(int(self.offsets[i]), int(self.offsets[i + 1])) for i in torch.as_tensor(indices).tolist()]
        longest = max(b - a for a, b in spans)
        shape = (len(spans), longest)
        input_ids = torch.full(shape, self.pad_id, dtype=torch.long)
        labels = torch.full(shape, self.ignore_index, dtype=torch.long)
        mask = torch.zeros(shape, dtype=torch.long)
        position_ids = None if self.position_ids is None else torch.zeros(shape, dtype=torch.long)
        for r, (a, b) in enumerate(spans):
            input_ids[r, : b - a] = self.input_ids[a:b]
            labels[r, : b - a] = self.labels[a:b]
            mask[r, : b - a] = 1
            if position_ids is not None:
                position_ids[r, : b - a] = self.position_ids[a:b]
        if mask_labels:
            labels.fill_(self.ignore_index)
        return Batch(input_ids, labels, position_ids, None if bool(mask.all()) else mask,
                     torch.as_tensor(indices, dtype=torch.long).reshape(-1))

    def padding_fraction(self, micro_batches: Sequence[torch.Tensor]) -> float:
        """Share of the tokens of these micro-batches (index tensors) that are padding."""
        lengths, used = self.lengths, self.tokens
        total = sum(int(lengths[idx].max()) * len(idx) for idx in micro_batches)
        return 1.0 - sum(int(used[idx].sum()) for idx in micro_batches) / max(1, total)
