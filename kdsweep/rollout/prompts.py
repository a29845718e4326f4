"""The prompts of a micro-batch, and the micro-batch that trains on their completions.

A row holds one sample (padded rows) or several (packed rows: positions restart at 0 with each). A sample's prompt
is everything before its last labelled span: an instruction's prompt, or a chat up to its last assistant turn, which
is the turn that gets regenerated. A sample with no labelled token has nothing to complete and is left out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kdsweep.data.batch import Batch


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    key: str
    """Where it comes from (its row in the split, and its place in the row): what seeds its draws."""


def _spans(batch: Batch, r: int) -> list[tuple[int, int]]:
    """[start, end) of each sample of row ``r``."""
    length = int(batch.attention_mask[r].sum()) if batch.attention_mask is not None else batch.input_ids.shape[1]
    if batch.position_ids is None:
        return [(0, length)]
    starts = (batch.position_ids[r, :length] == 0).nonzero().flatten().tolist() or [0]
    return list(zip(starts, starts[1:] + [length]))


def prompts_of(batch: Batch, ignore_index: int, room: int) -> list[Prompt]:
    """Every sample's prompt, cut from the left to at most ``room`` tokens (what leaves space for the completion)."""
    ids, labels = batch.input_ids.cpu(), batch.labels.cpu()
    rows = batch.rows.tolist() if batch.rows is not None else list(range(len(ids)))
    out = []
    for r in range(len(ids)):
        for k, (a, b) in enumerate(_spans(batch, r)):
            labelled = (labels[r, a:b] != ignore_index).nonzero().flatten()
            if len(labelled) == 0:
                continue
            # the last labelled span starts after the last unlabelled position before its end
            last = int(labelled[-1])
            gaps = (labels[r, a:a + last] == ignore_index).nonzero().flatten()
            first = int(gaps[-1]) + 1 if len(gaps) else 0  # its first labelled position (the prompt's last token)
            prompt = ids[r, a:a + first + 1].tolist()[-room:]
            out.append(Prompt(prompt, f"{rows[r]}.{k}"))
    return out


def completion_batch(prompts: list[Prompt], completions: list[list[int]], *, pad_id: int, ignore_index: int,
                     own_samples: bool) -> Batch:
    """Prompt + completion per row, labels on the completion only (right-padded, with an attention mask)."""
    from kdsweep.data.rows import Rows

    inputs, labels = [], []
    for p, c in zip(prompts, completions):
        seq = p.ids + c
        inputs.append(seq[:-1])
        labels.append([ignore_index] * (len(p.ids) - 1) + c)
    rows = Rows.from_rows(inputs, labels, None, [len(x) for x in inputs], pad_id=pad_id, ignore_index=ignore_index)
    return replace(rows.batch(list(range(len(inputs)))), own_samples=own_samples)


def empty_batch(batch: Batch, ignore_index: int, own_samples: bool) -> Batch:
    """A micro-batch without a prompt still runs the models (ranks stay in step) and counts no token."""
    return replace(batch, labels=torch.full_like(batch.labels, ignore_index), own_samples=own_samples)
