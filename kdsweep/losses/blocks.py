"""Per-token and per-span KD terms computed a block of rows at a time, each block's gradient taken at once.

A divergence over a real vocabulary builds several ``[rows, V]`` fp32 tensors (the teacher's log-probs, its
probabilities, the terms; GOLD and ULD also the merged distributions, the gathers over shared and unshared tokens,
the sorts) and autograd would keep most of them until the chunk's backward: three to nine chunk-sized buffers.
:class:`_BlockScores` instead scores the rows in blocks of :func:`block_rows` and differentiates each block before
the next one runs, keeping only the gradient with respect to the rows it read (``[rows, V]``, and a span's
continuation log-probs ``[M]``), so the loss path holds one block's temporaries at a time: O(block × V), a fixed
size, whatever the chunk. Nothing is recomputed: the backward only weighs the kept gradients by the upstream one, in
their own memory (so a graph of blocks is differentiated once, as a training step's is; a second backward raises).
Rows that fit in one block (a small vocabulary's whole chunk) skip all of it: one plain graph, differentiated by the
step's backward.

Exact: a token's term depends only on its own row (:func:`row_scores`), a span's only on its head row and its own
continuation entries (:func:`block_scores`; a position is the head of at most one span or the continuation of one,
never both), so the rows' gradients of a block's sum are each term's own, whatever the weights backward brings.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

BLOCK_ELEMENTS = 2**23
"""The elements of one block's ``[rows, V]`` tensor for a same-tokenizer divergence (:func:`row_scores`; 8M: 32 MB in
fp32, 65 rows at a 128k vocabulary). Its block holds about four such tensors (the teacher's rows, their log-probs,
the terms); halving it cost the live fused step 19% (smaller projections of the teacher's rows; 3 interleaved runs
each at 2,048 tokens of a 128k vocabulary) for 0.5 ``[chunk, V]`` buffer of its peak."""

SPAN_BLOCK_ELEMENTS = 2**22
"""The same for GOLD and ULD over spans (:mod:`~kdsweep.losses.aligned`; 4M: 16 MB, 27 spans at a 152k vocabulary). A
span block holds about ten (both sides' merged rows, the teacher's logits and log-probs, the coarse and unshared
gathers, the sorts, the terms): at 8M they were the fused step's peak, 2.7 buffers above a CE-only step at 2,048
tokens of a 152k teacher (``benchmarks/loss_scale.py``), at 4M 1.6-1.7, and the step 7% faster (2 interleaved
runs)."""


def block_rows(vocab: int, elements: int | None = None) -> int:
    """How many rows (spans) one block scores: ``elements`` (:data:`BLOCK_ELEMENTS`) over the larger vocabulary, at
    least one."""
    return max(1, (BLOCK_ELEMENTS if elements is None else elements) // max(vocab, 1))


Score = Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor]
"""``score(first, count, rows, c)``: the ``[count]`` terms of spans ``first`` … ``first + count − 1`` from their head
rows ``[count, V]`` and their continuations' log-probabilities ``[count]`` (0 for a one-token span)."""


class _BlockScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, log_q: torch.Tensor, head: torch.Tensor, cont: torch.Tensor, cont_token: torch.Tensor,
                cont_span: torch.Tensor, cont_at: list[int], rows_per_block: int, score: Score) -> torch.Tensor:
        needs = ctx.needs_input_grad[0]
        cont_q = log_q[cont].gather(-1, cont_token.long().unsqueeze(-1)).squeeze(-1)
        spans = len(head)
        grad_rows = log_q.new_empty(spans, log_q.shape[-1]) if needs else None
        grad_cont = log_q.new_empty(len(cont)) if needs else None
        values = []
        for first in range(0, spans, rows_per_block):
            count = min(rows_per_block, spans - first)
            lo, hi = cont_at[first], cont_at[first + count]
            with torch.enable_grad():
                rows = log_q[head[first:first + count]].detach().requires_grad_(needs)
                cq = cont_q[lo:hi].detach().requires_grad_(needs)
                c = rows.new_zeros(count).index_add(0, cont_span[lo:hi] - first, cq)
                value = score(first, count, rows, c)
                if needs:
                    g_rows, g_cont = torch.autograd.grad(value.sum(), [rows, cq], allow_unused=True)
                    grad_rows[first:first + count] = 0.0 if g_rows is None else g_rows
                    grad_cont[lo:hi] = 0.0 if g_cont is None else g_cont
            values.append(value.detach())
        if needs:
            ctx.save_for_backward(grad_rows, grad_cont, head, cont, cont_token, cont_span)
            ctx.shape = log_q.shape
        return torch.cat(values) if values else log_q.new_zeros(0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad_rows, grad_cont, head, cont, cont_token, cont_span = ctx.saved_tensors
        grad_rows.mul_(grad.unsqueeze(-1).to(grad_rows.dtype))  # in place: one backward per forward (a step's)
        if len(cont) == 0 and tuple(grad_rows.shape) == tuple(ctx.shape):  # row_scores: every row in order
            return grad_rows, None, None, None, None, None, None, None
        out = grad_rows.new_zeros(ctx.shape)
        out[head] = grad_rows
        out.index_put_((cont, cont_token.long()), grad_cont * grad[cont_span].to(grad_cont.dtype), accumulate=True)
        return out, None, None, None, None, None, None, None


def block_scores(log_q: torch.Tensor, head: torch.Tensor, cont: torch.Tensor, cont_token: torch.Tensor,
                 cont_span: torch.Tensor, cont_at: list[int], vocab: int, score: Score,
                 elements: int | None = None) -> torch.Tensor:
    """``[S]`` each span's term from the student's log-probs ``log_q`` ``[n, Vs]``, differentiable in ``log_q``: span
    s reads the row ``head[s]`` and the continuation entries ``(cont[j], cont_token[j])`` of span ``cont_span[j] = s``,
    j in ``cont_at[s]`` … ``cont_at[s + 1] − 1`` (in span order; ``cont_at`` host-side). ``vocab``: the larger of the
    two vocabularies; ``elements``: a block's size (:func:`block_rows`). Spans that fit in one block are scored as
    one plain differentiable graph (nothing to gain from a block's own gradient then)."""
    rows_per_block = block_rows(vocab, elements)
    if len(head) <= rows_per_block:
        cont_q = log_q[cont].gather(-1, cont_token.long().unsqueeze(-1)).squeeze(-1)
        return score(0, len(head), log_q[head], log_q.new_zeros(len(head)).index_add(0, cont_span, cont_q))
    return _BlockScores.apply(log_q, head, cont, cont_token, cont_span, cont_at, rows_per_block, score)


def row_scores(log_q: torch.Tensor, vocab: int,
               score: Callable[[int, int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``[n]`` each token's term from its own row of ``log_q`` ``[n, V]``, differentiable in ``log_q``:
    ``score(first, count, rows)`` gives rows ``first`` … ``first + count − 1``'s terms (all of them at once, as a plain
    graph, when they fit in one block)."""
    n, none = log_q.shape[0], torch.zeros(0, dtype=torch.long, device=log_q.device)
    if n <= block_rows(vocab):
        return score(0, n, log_q)
    return block_scores(log_q, torch.arange(n, device=log_q.device), none, none, none, [0] * (n + 1), vocab,
                        lambda first, count, rows, _c: score(first, count, rows))


__all__ = ["BLOCK_ELEMENTS", "SPAN_BLOCK_ELEMENTS", "block_rows", "block_scores", "row_scores"]
