"""The teacher-logit cache on disk: what one teacher pass keeps of every position of the tokenized rows.

Layout of ``<teacher.cache.dir or $KDSWEEP_CACHE/teacher>/<key>/``:

- ``meta.json``: the method, k, temperature, seed, vocabulary and dtype, each split's positions and parts, and what
  the build cost (seconds, ranks, device, teacher tokens);
- per split (``train``, ``eval``): ``<split>.rows``, the indices (int64, ascending) of the tokenization cache's rows
  it holds (``teacher.cache.rows``: the training rows the run's steps read, or all; every held-out row), and per
  field one raw file per building rank (``train.ids.0``, ``train.ids.1``, ...): the positions of those rows one
  after another, rank r's part a contiguous share of them, so a row never straddles two parts. Files are
  memory-mapped: the pages of a trial's rows are read when used and shared by every process on the machine.

Fields per position (``k`` = ``teacher.cache.k``; ids in uint16 up to a 65,536-token vocabulary, else int32):

=========  ===============================================================================================
full       ``logits`` [V] in the teacher's dtype (exact)
sample     ``ids`` [k] draws from softmax(logits / T_c); ``entropy`` [1] fp32 at T_c; ``label_logp`` [1] fp32
topk       ``ids`` [k], ``logp`` [k] fp16 log-probabilities at T_c; ``tail_logp`` [1] fp32; ``label_logp`` [1]
=========  ===============================================================================================

A teacher with another tokenizer (``aligned``) is kept on the student's positions too: at the head of each aligned
span (:mod:`kdsweep.losses.aligned`) the distribution of its first teacher token, as ``full``'s ``logits``
[V_teacher] (exact), ``sample``'s ``ids`` [k] draws at the loss's temperature, or ``topk``'s ``ids`` [k], ``logp``
[k] fp32 and ``tail_logp`` [1] (the tail is spread evenly over the tokens not listed); ``span`` [1] int32 (the
span's student positions after its head; −1 at a position that heads no span), ``cont_logp`` [2] fp32 the
teacher's log-probability of the span's later tokens at the loss's temperature and at 1, ``nll`` [1] fp32 its −log p
of the span's tokens; and at each row's first position ``row_counts`` [2] int32, the row's spans that could take no
KD term and its tokens in no span (run.json's alignment counts). A sparse one weighs what the same-tokenizer
sparse cache's ids and log-probabilities do, plus these 24 bytes (topk's log-probabilities in fp32, so that k = V − 1
is exact; no ``entropy`` nor ``label_logp``: the NLL is the teacher's CE here).

The key hashes the teacher's weights and config (their content, memoized by size and mtime, so moving the
directory keeps the key and editing a weight changes it), the tokenization cache's key, the rows it holds (all, or
the seed, batch size and steps that read them), the method, k, the temperature, the seed of the draws, the
vocabulary and the teacher's compute dtype. The cache is built once, under the same lock
and atomic rename as the tokenization cache (:func:`kdsweep.data.cache.built_once`): a killed build leaves only a
temp directory, which nothing reads.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kdsweep.config.schema import RunConfig
from kdsweep.data.cache import kdsweep_cache

CACHE_VERSION = 1
SPLITS = ("train", "eval")
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "uint16": 2, "int32": 4}


@dataclass(frozen=True)
class Spec:
    """What a cache holds; every field is part of its key."""

    method: str
    k: int
    temperature: float
    """T_c: the temperature of sample's draws and topk's log-probabilities (unused by full, which keeps logits)."""
    seed: int
    vocab: int
    """The vocabulary the teacher's distribution is taken over: the smaller of teacher's and student's."""
    dtype: str
    """The teacher's logits dtype (full stores it as is): float32 or bfloat16."""
    aligned: bool = False
    """Targets of a teacher with another tokenizer, on the student's positions (``vocab``: the teacher's; the
    continuation kept at ``temperature``, the loss's, and at 1)."""

    @classmethod
    def of(cls, cfg: RunConfig, vocab: int, aligned: bool = False) -> "Spec":
        c = cfg.teacher.cache
        full = c.method == "full"
        bf16 = cfg.train.dtype != "fp32"  # the teacher's weights and compute dtype
        temperature = cfg.loss.temperature if aligned else 1.0 if full else cfg.cache_temperature
        return cls(method=c.method, k=0 if full else c.k, temperature=temperature,
                   seed=c.seed if c.method == "sample" else 0, vocab=vocab, dtype="bfloat16" if bf16 else "float32",
                   aligned=aligned)

    @property
    def id_dtype(self) -> str:
        return "uint16" if self.vocab <= 65536 else "int32"

    def fields(self) -> dict[str, tuple[str, int]]:
        """field → (dtype, values per position)."""
        if self.aligned:
            spans = {"span": ("int32", 1), "cont_logp": ("float32", 2), "nll": ("float32", 1),
                     "row_counts": ("int32", 2)}
            if self.method == "full":
                return {"logits": (self.dtype, self.vocab), **spans}
            if self.method == "sample":
                return {"ids": (self.id_dtype, self.k), **spans}
            return {"ids": (self.id_dtype, self.k), "logp": ("float32", self.k), "tail_logp": ("float32", 1), **spans}
        if self.method == "full":
            return {"logits": (self.dtype, self.vocab)}
        if self.method == "sample":
            return {"ids": (self.id_dtype, self.k), "entropy": ("float32", 1), "label_logp": ("float32", 1)}
        return {"ids": (self.id_dtype, self.k), "logp": ("float16", self.k), "tail_logp": ("float32", 1),
                "label_logp": ("float32", 1)}

    def bytes_per_position(self) -> int:
        return sum(_BYTES[dtype] * width for dtype, width in self.fields().values())

    def describe(self) -> str:
        if self.aligned:
            head = (f"full logits ({self.vocab} per position, {self.dtype})" if self.method == "full" else
                    f"{self.method} (k={self.k} {'draws' if self.method == 'sample' else 'top tokens + tail'} at "
                    f"T={self.temperature:g})")
            return (f"{head} of a teacher with another tokenizer on the student's aligned spans (the continuation at "
                    f"T={self.temperature:g}; {self.bytes_per_position()} bytes per position)")
        if self.method == "full":
            return f"full logits ({self.vocab} per position, {self.dtype})"
        what = "draws" if self.method == "sample" else "top tokens + tail"
        return (f"{self.method} (k={self.k} {what} at T={self.temperature:g}, {self.bytes_per_position()} bytes per "
                "position)")


def cache_root(cfg: RunConfig) -> Path:
    return Path(cfg.teacher.cache.dir) if cfg.teacher.cache.dir else kdsweep_cache() / "teacher"


def teacher_hash(teacher_dir: Path, memo_dir: Path) -> str:
    """The content of the teacher's directory (weights, config, tokenizer), memoized by (path, size, mtime)."""
    from kdsweep.data.sources import content_hash

    return content_hash(str(teacher_dir), memo_dir)


def cache_key(spec: Spec, teacher_digest: str, data_key: str, coverage: Any = "all") -> str:
    """``coverage``: "all" training rows, or the seed, batch size and steps whose rows the cache holds."""
    kept = {k: v for k, v in asdict(spec).items() if k != "aligned" or v}  # same-tokenizer caches keep their keys
    parts = [CACHE_VERSION, kept, teacher_digest, data_key, coverage]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def cache_dir(cfg: RunConfig, spec: Spec, teacher_dir: Path, data_key: str, coverage: Any = "all") -> Path:
    """Where the cache of this teacher, these rows and this spec lives (built or not)."""
    root = cache_root(cfg)
    return root / cache_key(spec, teacher_hash(teacher_dir, root / "hashes"), data_key, coverage)


def read_meta(path: Path) -> dict[str, Any]:
    """A cache's ``meta.json``; one line when it is missing or not JSON (the cache is damaged)."""
    from kdsweep.data.integrity import read_artefact_json

    return read_artefact_json(path / "meta.json")
