"""Completing prompts with a model: sampled token by token with a KV cache, in eval mode, under ``torch.no_grad``,
stopping at EOS. Every rank steps in lockstep (a sharded model's forward is a collective) until every rank's
prompts are done. Each prompt draws from its own seeded stream, on the CPU, so its completion is the same whichever
rank completes it and whatever else is in its batch. Generation runs eagerly even where the decoder layers are
compiled (``dist.compile``): every new length would recompile them, and the training step keeps its graphs.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from kdsweep.distributed import DistEnv
from kdsweep.distributed.fsdp import hf_model


def cache_argument(model: nn.Module) -> str:
    """What the model's forward calls its KV cache: ``cache`` (transformers 5.2x), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(type(hf_model(model)).forward).parameters else "past_key_values"


def sample(logits: torch.Tensor, temperature: float, top_p: float, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``logits`` ``[B, V]`` (float32, CPU), at ``temperature`` within the top-``top_p`` mass."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p > top_p  # tokens after the nucleus is full (the first always stays)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(outside, 0.0))
    return torch.stack([torch.multinomial(p, 1, generator=g)[0] for p, g in zip(probs, generators)])


@torch.no_grad()
def complete(model: nn.Module, prompts: list[list[int]], seeds: list[int], *, max_new_tokens: int, temperature: float,
             top_p: float, stop_ids: set[int], pad_id: int, vocab: int, device: torch.device,
             dist: DistEnv) -> list[list[int]]:
    """Each prompt's completion (its stop token included when one came). A rank with no prompt completes a dummy
    one, so that it joins every forward of the others."""
    dummy = not prompts
    if dummy:
        prompts, seeds = [[pad_id]], [0]
    was_training = model.training
    model.eval()
    longest = max(map(len, prompts))
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):  # left-padded: every prompt ends where generation starts
        ids[r, longest - len(p):] = torch.tensor(p)
        mask[r, longest - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    out: list[list[int]] = [[] for _ in prompts]
    done = torch.zeros(len(prompts), dtype=torch.bool)
    step_ids, cache, kw = ids, None, cache_argument(model)
    try:
        with torch.compiler.set_stance("force_eager"):  # eager, compiled layers or not (see above)
            for _ in range(max_new_tokens):
                o = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                          **{kw: cache})
                cache = getattr(o, kw)
                tokens = sample(o.logits[:, -1, :vocab].float().cpu(), temperature, top_p, generators)
                for r, t in enumerate(tokens.tolist()):
                    if not done[r]:
                        out[r].append(t)
                        done[r] = t in stop_ids
                if not dist.any(not bool(done.all())):  # lockstep: go on while any rank has a prompt to finish
                    break
                step_ids = tokens.masked_fill(done, pad_id).unsqueeze(-1).to(device)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
                positions = positions[:, -1:] + 1
    finally:
        model.train(was_training)
    return [] if dummy else out
