"""The live teacher: the frozen model runs on every micro-batch (``teacher.logits=live``)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from kdsweep.data.batch import Batch
from kdsweep.losses.targets import Logits
from kdsweep.models.heads import frozen_hidden, frozen_projection, output_layer
from kdsweep.teacher.source import TeacherSource


class LiveTeacher(TeacherSource):
    """Logits of the teacher ``model`` (eval mode, frozen). With ``fused`` it gives the final hidden states and
    its output layer instead, projected chunk by chunk by the loss, so no ``[B, T, V]`` tensor exists; the layer is
    unsharded (FSDP) until the context ends."""

    def __init__(self, model: nn.Module, fused: bool = False) -> None:
        self.model, self.fused = model, fused
        self.tokens_computed, self.tokens_read = 0, 0

    @property
    def share_key(self) -> tuple:
        return "live", id(self.model), self.fused

    @contextmanager
    def targets(self, batch: Batch) -> Iterator[Logits]:
        self.tokens_computed += batch.input_ids.numel()  # padding too: the model computes it
        with torch.no_grad():  # only the teacher's forward: what the caller does with the targets needs grads
            out = frozen_hidden(self.model, batch.inputs()) if self.fused else self.model(**batch.inputs()).logits
        if not self.fused:
            yield Logits(logits=out)
            return
        with frozen_projection(self.model) as head:
            yield Logits(hidden=out, head=head, rows=output_layer(self.model).weight.shape[0])
