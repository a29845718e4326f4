"""Cheap checks of model directories before anything is loaded (JSON reads only; no torch).

They turn the usual ways a KD job dies minutes in — a wrong path, a directory that is not an HF model,
teacher and student with different tokenizers, a sequence longer than the model's context — into one line
before the job starts.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from kdsweep.config.schema import ConfigError, ModelSource, RunConfig

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def check_model_dir(section: str, path: str) -> dict[str, Any]:
    """The model's config.json as a dict, or a ConfigError naming ``section.path`` and the fix."""
    d = Path(path)
    if not d.exists():
        raise ConfigError(f"{section}.path={path} does not exist; pass {section}.path=<a local HF model directory>")
    if not (d / "config.json").is_file():
        raise ConfigError(
            f"{section}.path={path} is not a Hugging Face model directory (no config.json); "
            "point it at the folder save_pretrained() wrote"
        )
    if not any((d / w).is_file() for w in WEIGHT_FILES):
        raise ConfigError(f"{section}.path={path} has no weights ({' or '.join(WEIGHT_FILES[::2])})")
    return json.loads((d / "config.json").read_text())


def tokenizer_fingerprint(section: str, path: str) -> tuple[str, int]:
    """(hash of the vocabulary, vocabulary size including added tokens) of the tokenizer saved in ``path``."""
    d = Path(path)
    if (d / "tokenizer.json").is_file():
        tok = json.loads((d / "tokenizer.json").read_text())
        vocab = dict(tok["model"].get("vocab") or {})
        if isinstance(tok["model"].get("vocab"), list):  # unigram: [[piece, score], ...]
            vocab = {piece: i for i, (piece, _) in enumerate(tok["model"]["vocab"])}
        vocab.update({t["content"]: t["id"] for t in tok.get("added_tokens", [])})
        blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1])).encode()
        return hashlib.sha256(blob).hexdigest(), max(vocab.values()) + 1 if vocab else 0
    if (d / "tokenizer.model").is_file():
        blob = (d / "tokenizer.model").read_bytes()
        return hashlib.sha256(blob).hexdigest(), -1
    raise ConfigError(f"{section}.path={path} has no tokenizer (tokenizer.json or tokenizer.model); save one beside the model")


def _source(section: str, src: ModelSource) -> tuple[str | None, dict[str, Any]]:
    """(directory or None for a not-yet-built zoo model, what is known of its config)."""
    if src.path is not None:
        return src.path, check_model_dir(section, src.path)
    from kdsweep.models import zoo  # imports no torch at module level

    return None, {"max_position_embeddings": zoo.max_positions(src.zoo)}


def preflight_models(cfg: RunConfig) -> None:
    """Raise a ConfigError for any model problem that can be seen without loading weights."""
    s_dir, s_cfg = _source("model", cfg.model)
    t_dir, t_cfg = _source("teacher", cfg.teacher)
    for section, conf in (("model", s_cfg), ("teacher", t_cfg)):
        limit = conf.get("max_position_embeddings")
        if limit is not None and cfg.data.seq_len > limit:
            raise ConfigError(
                f"data.seq_len={cfg.data.seq_len} is beyond the {section}'s {limit} positions "
                f"(max_position_embeddings); pass data.seq_len=<at most {limit}>"
            )
    if s_dir is None or t_dir is None:
        if (s_dir is None) != (t_dir is None):
            raise ConfigError(
                "model and teacher mix an embedded tiny model with a local directory; they would not share a "
                "tokenizer. Use model=tiny teacher=tiny, or two directories"
            )
        return  # both from the zoo: one tokenizer by construction
    s_fp, s_vocab = tokenizer_fingerprint("model", s_dir)
    t_fp, _ = tokenizer_fingerprint("teacher", t_dir)
    if s_fp != t_fp:
        raise ConfigError(
            f"teacher.path={t_dir} and model.path={s_dir} have different tokenizers; token-level distillation "
            "needs one shared vocabulary: pick a teacher and student from the same model family"
        )
    smallest = min(s_cfg.get("vocab_size", s_vocab), t_cfg.get("vocab_size", s_vocab))
    if s_vocab > smallest:
        raise ConfigError(
            f"the tokenizer has {s_vocab} tokens but one model's output layer has only {smallest} rows "
            "(vocab_size in config.json); the models do not match their tokenizer"
        )
