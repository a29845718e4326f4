"""The data of a run: sources → held-out split → samples → mix → rows, tokenized once and cached on disk.

1. **Read** every source (:mod:`kdsweep.data.sources`); no ``data.datasets`` means the embedded corpus.
2. **Hold out**: the ``data.eval_datasets``, or a seeded ``eval_fraction`` of each training source's rows; and the
   test split, if any: the ``data.test_datasets``, or a seeded ``test_fraction`` of what the eval split left.
3. **Render** each row into a sample, prompts masked (:mod:`kdsweep.data.formats`).
4. **Mix** the training samples: all of them in source order (``concat``), or ``weighted`` by the sources'
   weights (:mod:`kdsweep.data.mixing`).
5. **Rows** of ``seq_len`` tokens: ``stream``, ``pack`` or ``pad`` (:mod:`kdsweep.data.packing`).

Nothing here depends on the rank or the world size. The result is cached in ``<cache>/<key>/`` where the key
hashes everything that determines it: the sources' content, the tokenizer's files, the chat template and every
data setting that shapes the rows (not the batch sizes). The first job to need it builds it under a lock (see
:mod:`kdsweep.data.cache`); every later trial and every rank memory-maps the same files.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kdsweep.config.schema import ConfigError, DataConfig, DatasetConfig
from kdsweep.data import integrity
from kdsweep.data.cache import built_once
from kdsweep.data.formats import FormatSpec, Sample, chat_template, render
from kdsweep.data.mixing import split_indices, weighted_mix
from kdsweep.data.packing import apply_length_policy, pack, windows
from kdsweep.data.rows import Rows
from kdsweep.data.key import cache_root, data_key
from kdsweep.data.sources import eval_sources, read_rows, test_sources, train_sources

log = logging.getLogger(__name__)


class ChatView(Protocol):
    """A second model's reading of each chat sample (:attr:`~kdsweep.data.formats.FormatSpec.chat_view`)."""

    identity: str
    """What its readings depend on (the second tokenizer, its template): part of the rows' cache key."""

    def __call__(self, messages: list[dict[str, Any]], rendering: Any, ids: list[int], where: str) -> Any: ...


TARGETS = {"text": "every token", "instruction": "the output column", "chat": "messages whose role is 'assistant'"}
"""What each format trains on (without ``train_on_prompt``)."""


@dataclass(frozen=True)
class RunData:
    train: Rows
    eval: Rows
    test: Rows | None
    """The test split (``data.test_fraction`` or ``data.test_datasets``; None: the data has none)."""
    stats: dict[str, Any]
    """Per split: samples, rows, tokens, targets, truncated, dropped, padding_fraction; per source: rows read,
    held out, samples in the mix."""
    cache_dir: Path
    reused: bool
    """True when the cache already held these rows (nothing was tokenized)."""
    seconds: float


def load_data(cfg: DataConfig, tokenizer: Any, tokenizer_dir: Path, ignore_index: int = -100,
              chat_view: ChatView | None = None) -> RunData:
    """The run's rows, from the cache or built into it (safe when many jobs ask at once); ``chat_view``: a second
    model's reading of each chat sample, kept with the rows (its ``identity`` is part of the cache key)."""
    t0 = time.perf_counter()
    root = cache_root(cfg)
    view = None if chat_view is None else chat_view.identity
    with built_once(root, data_key(cfg, tokenizer_dir, ignore_index, view)) as (final, tmp):
        if tmp is not None:
            splits, stats = build(cfg, tokenizer, ignore_index, chat_view)
            for name, rows in splits.items():
                rows.save(tmp / f"{name}.pt")
            (tmp / "stats.json").write_text(json.dumps(stats, indent=1))
    test = final / "test.pt"
    data = RunData(Rows.load(final / "train.pt"), Rows.load(final / "eval.pt"),
                   Rows.load(test) if test.is_file() else None, integrity.read_artefact_json(final / "stats.json"),
                   final, reused=tmp is None, seconds=time.perf_counter() - t0)
    if data.reused:
        log.info("data: reused the tokenization cache %s (nothing tokenized; loaded in %.3f s)", final, data.seconds)
    else:
        log.info("data: tokenized and cached in %s in %.2f s", final, data.seconds)
    for split, stats in data.stats.items():
        log.info("data %s: %s", split, describe(stats, cfg))
    return data


def describe(s: dict[str, Any], cfg: DataConfig) -> str:
    """One line of a split's counts."""
    shares = ", ".join(f"{Path(src['path']).name} {src['share']:.1%}" for src in s["sources"])
    padding = "" if s["padding_fraction"] is None else f", padding {s['padding_fraction']:.1%}"
    return (f"{s['samples']} samples ({shares}) -> {s['rows']} rows ({cfg.sequences}, seq_len {cfg.seq_len}): "
            f"{s['tokens']} tokens, {s['targets']} targets, {s['truncated']} truncated, {s['dropped']} dropped"
            f"{padding}")


def build(cfg: DataConfig, tokenizer: Any, ignore_index: int,
          chat_view: ChatView | None = None) -> tuple[dict[str, Rows], dict[str, Any]]:
    """The rows of each split (train, eval, and test when the data has one) and their stats (no cache)."""
    template = chat_template(cfg.chat_template)

    def samples_of(key: str, ds: DatasetConfig, rows: list[dict[str, Any]], picks: list[int]) -> list[Sample]:
        spec = FormatSpec.of(ds, key, chat_template=template, train_on_prompt=cfg.train_on_prompt,
                             add_bos=cfg.add_bos, ignore_index=ignore_index, chat_view=chat_view)
        return [render(rows[i], spec, tokenizer, where=f"{key}: {ds.path} row {i + 1}") for i in picks]

    def info(key: str, ds: DatasetConfig, rows_read: int, **more: Any) -> dict[str, Any]:
        return {"key": key, "path": ds.path, "format": ds.format, "rows_read": rows_read, **more}

    train_parts, train_info = [], []
    held_parts: dict[str, list[list[Sample]]] = {"eval": [], "test": []}
    held_info: dict[str, list[dict[str, Any]]] = {"eval": [], "test": []}
    for key, ds in train_sources(cfg):
        if cfg.mix == "weighted" and ds.weight == 0:  # left out: neither trained on nor held out
            train_parts.append([])
            train_info.append(info(key, ds, 0, held_out=0, weight=0.0))
            continue
        rows = read_rows(ds.path, split=ds.split, key=f"{key}.path")
        kept, held, test = split_indices(len(rows), cfg)
        if not kept:
            raise ConfigError(f"{key}.path: {ds.path} holds {len(rows)} row(s), too few to hold out "
                              f"data.eval_fraction={cfg.eval_fraction} and data.test_fraction={cfg.test_fraction}; "
                              "add rows or set data.eval_datasets")
        train_parts.append(samples_of(key, ds, rows, kept))
        if not any(label != ignore_index for sample in train_parts[-1] for label in sample.labels):
            raise ConfigError(
                f"{key}.path: {ds.path}: no row has a token to train on (format {ds.format} trains on "
                f"{TARGETS[ds.format]}); fix the data or its columns, or set data.train_on_prompt=true"
            )
        train_info.append(info(key, ds, len(rows), held_out=len(held), weight=ds.weight,
                               **({"test": len(test)} if test else {})))
        for split, picks in (("eval", held), ("test", test)):
            if picks:
                held_parts[split].append(samples_of(key, ds, rows, picks))
                held_info[split].append(info(key, ds, len(picks)))
    for split, sources in (("eval", eval_sources(cfg)), ("test", test_sources(cfg))):
        for key, ds in sources:
            rows = read_rows(ds.path, split=ds.split, key=f"{key}.path")
            held_parts[split].append(samples_of(key, ds, rows, list(range(len(rows)))))
            held_info[split].append(info(key, ds, len(rows)))

    if cfg.mix == "weighted":
        sizes = [len(p) for p in train_parts]
        picks = weighted_mix(sizes, [ds.weight for _, ds in train_sources(cfg)], cfg.mix_samples or sum(sizes),
                             cfg.split_seed)
        train_samples = [train_parts[s][i] for s, i in picks]
        drawn = [sum(s == k for s, _ in picks) for k in range(len(sizes))]
        for info, n, size in zip(train_info, drawn, sizes):
            if size and not n:
                log.warning("data: %s gives no sample to the mix: data.mix_samples=%d is too small for its weight",
                            info["key"], cfg.mix_samples)
    else:
        train_samples = [s for part in train_parts for s in part]
        drawn = [len(p) for p in train_parts]
    for info, n in zip(train_info, drawn):
        info.update(samples=n, share=n / max(1, len(train_samples)))
    splits, stats = {}, {}
    splits["train"], stats["train"] = make_rows(train_samples, cfg, pad_id(tokenizer), ignore_index)
    stats["train"]["sources"] = train_info
    for split in ("eval", "test") if held_parts["test"] else ("eval",):
        samples = [s for part in held_parts[split] for s in part]
        for info, part in zip(held_info[split], held_parts[split]):
            info.update(samples=len(part), share=len(part) / max(1, len(samples)))
        splits[split], stats[split] = make_rows(samples, cfg, pad_id(tokenizer), ignore_index)
        stats[split]["sources"] = held_info[split]
    for split, rows in splits.items():
        if len(rows) == 0:
            raise ConfigError(f"data: the {'training' if split == 'train' else split} split makes no rows of "
                              f"data.seq_len={cfg.seq_len} tokens; "
                              + no_rows_fix(cfg, stats[split], stats["train"]["tokens"], stats["eval"]["tokens"]))
    return splits, stats


def pad_id(tokenizer: Any) -> int:
    """What fills rows past their end: the tokenizer's pad token, or EOS when it has none."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def no_rows_fix(cfg: DataConfig, stats: dict[str, Any], train_tokens: int, eval_tokens: int) -> str:
    """What to change when a split makes no rows, from what it and the two splits hold."""
    if stats["dropped"] and cfg.truncation == "drop":
        return "every sample is longer; use data.truncation=truncate or a larger data.seq_len"
    fewest = min(train_tokens, eval_tokens)
    if cfg.sequences == "stream" and fewest > 1:
        return (f"the training and eval splits hold {train_tokens} and {eval_tokens} tokens: "
                f"pass data.seq_len=<at most {fewest - 1}> or add data")
    return "add data"


def make_rows(samples: list[Sample], cfg: DataConfig, pad_id: int, ignore_index: int) -> tuple[Rows, dict[str, Any]]:
    """Rows of ``samples`` as ``cfg.sequences`` says, and their counts."""
    make = lambda *a, **kw: Rows.from_rows(*a, **kw, pad_id=pad_id, ignore_index=ignore_index)
    if cfg.sequences == "stream":
        stream = [t for s in samples if len(s) for t in (*s.input_ids, s.labels[-1])]
        w = windows(stream, cfg.seq_len)
        rows = make(w[:, :-1], w[:, 1:], None, [cfg.seq_len] * len(w))
        return rows, {"samples": len(samples), "rows": len(w), "tokens": len(stream),
                      "targets": int((w[:, 1:] != ignore_index).sum()), "truncated": 0, "dropped": 0,
                      "padding_fraction": 0.0}
    if cfg.sequences == "pack":
        p = pack(samples, cfg.seq_len, pad_id=pad_id, policy=cfg.truncation, strategy=cfg.pack_strategy,
                 ignore_index=ignore_index)
        rows = make(p.input_ids, p.labels, p.position_ids, p.used, views=p.views)
        st = p.stats
        return rows, {"samples": st.samples, "rows": st.sequences, "tokens": st.tokens, "targets": st.targets,
                      "truncated": st.truncated, "dropped": st.dropped, "padding_fraction": st.padding_fraction}
    kept, c = apply_length_policy(samples, cfg.seq_len, cfg.truncation, ignore_index)
    views = [[s.view] for s in kept] if any(s.view is not None for s in kept) else None
    rows = make([s.input_ids for s in kept], [s.labels for s in kept], None, [len(s) for s in kept], views=views)
    # padding depends on how rows meet in micro-batches: the training loop measures it
    return rows, {"samples": c.samples, "rows": len(kept), "tokens": c.tokens, "targets": c.targets,
                  "truncated": c.truncated, "dropped": c.dropped, "padding_fraction": None}
