"""The teacher-cache build (kdsweep.teacher.build): what it writes equals what the teacher's own full logits give,
a block of positions at a time, for every method; no tensor of more than a block's ``[rows, V]`` exists while a
teacher whose output layer is its logits builds, where the plain ``[B, T, V]`` forward would hold them all; and a
``full`` cache is read back a block of rows at a time, as the loss uses them (kdsweep.teacher.cached)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import one_thread  # noqa: F401
from kdsweep.data.rows import Rows
from kdsweep.data.sampling import stream_seed
from kdsweep.distributed import DistEnv
from kdsweep.losses import blocks
from kdsweep.losses.targets import Logits
from kdsweep.teacher.build import DTYPES, PlainTargets, Selection, ensure, row_targets, write_split
from kdsweep.teacher.cached import CachedSplit, CachedTeacher
from kdsweep.teacher.cache import Spec

V, IGNORE, LENGTHS = 300, -100, (37, 50, 9, 23)
ROWS_PER_BLOCK = 4


def teacher(kind: str) -> torch.nn.Module:
    """A tiny random-init Llama (its output layer gives its logits), or Gemma 2 (it soft-caps them after it)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    common = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    return Gemma2ForCausalLM(Gemma2Config(**common, head_dim=8, final_logit_softcapping=3.0)).eval()


def rows() -> Rows:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, V, (n,), generator=g).tolist() for n in LENGTHS]
    labels = [r[1:] + [IGNORE] for r in ids]
    labels[1][:3] = [IGNORE] * 3
    return Rows.from_rows(ids, labels, None, list(LENGTHS), pad_id=0, ignore_index=IGNORE)


def spec(method: str) -> Spec:
    return Spec(method=method, k=0 if method == "full" else 6, temperature=1.0 if method == "full" else 1.5,
                seed=11 if method == "sample" else 0, vocab=V, dtype="float32")


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 4 positions, so every row is several blocks and the longest a partial last one."""
    monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", ROWS_PER_BLOCK * V)


def built(model: torch.nn.Module, s: Spec, out: Path, data: Rows) -> dict[str, torch.Tensor]:
    """The build's files (one rank, two rows a batch), field → ``[positions, width]``."""
    selected = torch.tensor([0, 1, 3])  # row 2 not in the cache
    write_split(PlainTargets(model, s, IGNORE, torch.device("cpu")), Selection(data, selected), "train", s, out,
                DistEnv(rank=0, world_size=1), torch.device("cpu"), batch_rows=2)
    return {name: torch.from_file(str(out / f"train.{name}.0"), size=sum(LENGTHS[i] for i in selected) * width,
                                  dtype=DTYPES[dtype]).view(-1, width)
            for name, (dtype, width) in s.fields().items()}


def reference(model: torch.nn.Module, s: Spec, data: Rows) -> dict[str, torch.Tensor]:
    """Each row alone through the teacher's own forward, its whole ``[L, V]`` logits into :func:`row_targets`."""
    out: dict[str, list[torch.Tensor]] = {}
    g = torch.Generator() if s.method == "sample" else None
    for row in (0, 1, 3):
        batch = data.batch([row])
        with torch.no_grad():
            logits = model(**batch.inputs()).logits[0]
        if g is not None:
            g.manual_seed(stream_seed(s.seed, "train", row))
        for name, t in row_targets(logits, batch.labels[0], s, IGNORE, g).items():
            out.setdefault(name, []).append(t)
    return {name: torch.cat(ts) for name, ts in out.items()}


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
@pytest.mark.parametrize("method", ["full", "sample", "topk"])
def test_the_build_writes_what_the_teachers_own_logits_give(kind, method, small_blocks, tmp_path):
    model, s, data = teacher(kind), spec(method), rows()
    got, want = built(model, s, tmp_path, data), reference(model, s, data)
    assert got.keys() == want.keys()
    for name in want:
        if want[name].is_floating_point():
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=name)
        else:  # the draws (one stream per row through its blocks) and the top tokens
            assert torch.equal(got[name].long(), want[name].long()), name


class Widest(TorchDispatchMode):
    """The most elements of any tensor an op returns whose last dimension is the vocabulary (but views of the
    model's weights: the output layer's, transposed)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.most, self.weights = 0, {p.untyped_storage().data_ptr() for p in model.parameters()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == V and \
                    t.untyped_storage().data_ptr() not in self.weights:
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_only_a_block_of_logits_exists_when_the_output_layer_gives_them(kind, small_blocks, tmp_path):
    model, data = teacher(kind), rows()
    with Widest(model) as widest:
        built(model, spec("topk"), tmp_path, data)
    if kind == "llama":  # the hidden states projected a block at a time
        assert widest.most == ROWS_PER_BLOCK * V
    else:  # soft-capped after the output layer: its own forward's [B, T, V] logits, read a block at a time
        assert widest.most == 2 * max(LENGTHS) * V


def test_a_full_cache_is_read_a_block_of_rows_at_a_time_and_gives_the_teachers_targets(small_blocks, tmp_path,
                                                                                        monkeypatch):
    model, s, data, cpu = teacher("llama"), spec("full"), rows(), torch.device("cpu")
    splits = {"train": Selection(data, torch.tensor([0, 1, 3])), "eval": Selection(data, torch.tensor([2]))}
    path, _ = ensure(tmp_path, "key", s, splits, lambda: PlainTargets(model, s, IGNORE, cpu),
                     DistEnv(rank=0, world_size=1), cpu, 2, {})
    split = CachedSplit(path, "train", data)
    reads, gather_at = [], split.gather_at
    monkeypatch.setattr(split, "gather_at", lambda where, name, at: reads.append(len(at)) or gather_at(where, name, at))
    batch = data.batch([3, 0, 1])  # padded to the longest row
    with torch.no_grad():
        dense = Logits(logits=model(**batch.inputs()).logits)
    log_q = torch.log_softmax(torch.randn(batch.input_ids.numel(), V, generator=torch.Generator().manual_seed(1)), -1)
    labels = batch.labels.reshape(-1)
    with CachedTeacher(split, cpu).targets(batch) as cached:
        assert len(cached) == batch.input_ids.numel() and cached.vocab == V
        for divergence in ("forward_kl", "jsd"):
            got = cached.divergence(log_q, divergence, 0.5, 2.0)
            assert reads and max(reads) == ROWS_PER_BLOCK and sum(reads) == len(cached)  # a block at a time
            inside = labels != IGNORE  # padding: no cached logits (zero), and never a label
            torch.testing.assert_close(got[inside], dense.divergence(log_q, divergence, 0.5, 2.0)[inside])
            reads.clear()
        torch.testing.assert_close(cached.teacher_ce(labels, V, IGNORE), dense.teacher_ce(labels, V, IGNORE))
