"""Cheap checks of model directories before anything is loaded (JSON reads only; no torch).

They turn the usual ways a KD job dies minutes in — a wrong path, a hub id missing from the cache, a directory
that is not an HF model, teacher and student with tokenizers that cannot be aligned, a sequence longer than the model's
context, a fused loss on a model that transforms its logits — into one line before the job starts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from kdsweep import hub
from kdsweep.config.schema import ConfigError, ModelSource, RunConfig

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def check_model_dir(section: str, path: str, d: Path | None = None) -> dict[str, Any]:
    """The model's config.json as a dict, or a ConfigError naming ``section.path`` and the fix.

    ``d`` is where ``path`` lies when it is not a directory itself (the cached snapshot of a hub id)."""
    d = Path(path) if d is None else d
    if not d.exists():
        raise ConfigError(f"{section}.path={path} does not exist; pass {section}.path=<a local HF model directory>")
    where = f"{section}.path={path}" + ("" if str(d) == path else f" ({d})")
    if not (d / "config.json").is_file():
        raise ConfigError(
            f"{where} is not a Hugging Face model directory (no config.json); "
            "point it at the folder save_pretrained() wrote"
        )
    if not any((d / w).is_file() for w in WEIGHT_FILES):
        raise ConfigError(f"{where} has no weights ({' or '.join(WEIGHT_FILES[::2])})")
    return json.loads((d / "config.json").read_text())


def tokenizer_fingerprint(section: str, path: str) -> tuple[str, int]:
    """(hash of the vocabulary, vocabulary size including added tokens) of the tokenizer saved in ``path``.

    Computed once per file in a process (a job's checks ask for it several times, and a real tokenizer.json is
    10-35 MB of JSON: ~1 s a parse), and once per content (a teacher and a student of one family hold the same file):
    a file rewritten in place has another size or mtime, so it is read again."""
    d = Path(path)
    for name in ("tokenizer.json", "tokenizer.model"):
        if (d / name).is_file():
            stat = (d / name).stat()
            return _file_fingerprint(str((d / name).resolve()), stat.st_size, stat.st_mtime_ns)
    raise ConfigError(f"{section}.path={path} has no tokenizer (tokenizer.json or tokenizer.model); "
                      "save one beside the model")


_BY_CONTENT: dict[bytes, tuple[str, int]] = {}
"""A tokenizer file's sha256 -> its fingerprint (:func:`tokenizer_fingerprint`)."""


@functools.lru_cache(maxsize=32)
def _file_fingerprint(file: str, size: int, mtime_ns: int) -> tuple[str, int]:
    del size, mtime_ns  # the cache's key: the file as it is now
    raw = Path(file).read_bytes()
    digest = hashlib.sha256(raw).digest()
    if digest not in _BY_CONTENT:
        _BY_CONTENT[digest] = _vocab_fingerprint(raw) if file.endswith(".json") else (digest.hex(), -1)
    return _BY_CONTENT[digest]


def _vocab_fingerprint(raw: bytes) -> tuple[str, int]:
    tok = json.loads(raw)
    vocab = dict(tok["model"].get("vocab") or {})
    if isinstance(tok["model"].get("vocab"), list):  # unigram: [[piece, score], ...]
        vocab = {piece: i for i, (piece, _) in enumerate(tok["model"]["vocab"])}
    vocab.update({t["content"]: t["id"] for t in tok.get("added_tokens", [])})
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1])).encode()
    return hashlib.sha256(blob).hexdigest(), max(vocab.values()) + 1 if vocab else 0


def _launching() -> bool:
    """Whether this process launches the job rather than being one of its ranks (torchrun, SLURM tasks): only the
    launcher may fill the hub cache, so N ranks never download the same model at once."""
    return "RANK" not in os.environ and int(os.environ.get("SLURM_NTASKS", "1") or 1) <= 1


def _source(section: str, src: ModelSource) -> tuple[str | None, dict[str, Any]]:
    """(directory or None for a not-yet-built zoo model, what is known of its config). A hub id is resolved
    here, in the launching process, and downloaded into the cache if it is missing and the hub is reachable."""
    if src.path is not None:
        d = hub.model_dir(f"{section}.path", src.path, download=_launching())
        return str(d), check_model_dir(section, src.path, d)
    from kdsweep.models import zoo  # imports no torch at module level

    return None, {"max_position_embeddings": zoo.max_positions(src.zoo), "vocab_size": zoo.vocab_size(src.zoo)}


LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config fields of architectures that transform their logits after the output layer (Gemma 2's soft-capping,
Cohere's scale, Granite's scaling): the fused loss, which projects hidden states itself, cannot apply them."""


def logit_transform(config: dict[str, Any]) -> tuple[str, Any] | None:
    """(field, value) of the first logit transform a model's config.json sets, or None."""
    for conf in (config, config.get("text_config") or {}):
        for name in LOGIT_TRANSFORMS:
            if conf.get(name) not in (None, 1, 1.0):
                return name, conf[name]
    return None


def _vocab(config: dict[str, Any]) -> int:
    """The output layer's rows, from config.json (Gemma 3 and other multimodal configs nest it in text_config)."""
    return int(config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size") or 0)


def _zoo_tokenizer_dir(name: str) -> str:
    from kdsweep.models import zoo

    return str(zoo.tokenizer_dir(zoo.TOKENIZER_OF[name]))


FORCE_CROSS_TOKENIZER = "KDSWEEP_TEST_FORCE_CROSS_TOKENIZER"
"""Test-only: a teacher with the student's own tokenizer takes the cross-tokenizer path (its identity test)."""


def cross_tokenizer(cfg: RunConfig) -> bool:
    """Whether the teacher's tokenizer is not the student's (the cross-tokenizer path), or the test switch is set."""
    if os.environ.get(FORCE_CROSS_TOKENIZER) == "1":
        return True
    s_dir, _ = _source("model", cfg.model)
    t_dir, _ = _source("teacher", cfg.teacher)
    if s_dir is None and t_dir is None:  # two zoo models: their tokenizers are known by name
        from kdsweep.models import zoo

        return zoo.TOKENIZER_OF[cfg.model.zoo] != zoo.TOKENIZER_OF[cfg.teacher.zoo]
    s_tok = s_dir or _zoo_tokenizer_dir(cfg.model.zoo)
    t_tok = t_dir or _zoo_tokenizer_dir(cfg.teacher.zoo)
    return s_tok != t_tok and tokenizer_fingerprint("model", s_tok)[0] != tokenizer_fingerprint("teacher", t_tok)[0]


def check_cross_tokenizer(cfg: RunConfig, several: bool = False) -> None:
    """What a teacher with another tokenizer cannot do yet, each in one line (``several``: it is one of several
    teachers)."""
    from kdsweep.data.sources import eval_sources, train_sources
    from kdsweep.teacher.align import byte_level

    fix = "or pick a teacher with the student's tokenizer"
    if cfg.rollout.lmbda > 0 or cfg.rollout.seq_kd:
        raise ConfigError("rollout.lmbda and rollout.seq_kd: generation with a teacher of another tokenizer is not "
                          f"supported yet; use lmbda=0 rollout.seq_kd=false, {fix}")
    if cfg.train.eval_test:
        raise ConfigError("train.eval_test: a teacher of another tokenizer cannot score the test split yet; pass "
                          f"train.eval_test=false, {fix}")
    sources = [*train_sources(cfg.data), *eval_sources(cfg.data)]
    chats = [key for key, ds in sources if ds.format == "chat"]  # one teacher reads each in its own template
    if chats and several:
        raise ConfigError(f"{chats[0]}.format=chat: among several teachers, one with another tokenizer than the "
                          "student's cannot read chat rows in its own template yet; use one teacher, or teachers "
                          "with the student's tokenizer")
    if chats and len(chats) < len(sources):
        other = next(key for key, ds in sources if ds.format != "chat")
        raise ConfigError(f"{other} is not chat but {chats[0]} is: a teacher with another tokenizer reads chat rows in "
                          "its own template and other rows from the student's tokens, not both in one run yet; use "
                          f"sources of one kind, {fix}")
    for section, src in (("model", cfg.model), ("teacher", cfg.teacher)):
        d = _source(section, src)[0] if src.path is not None else None  # the zoo's tokenizers are both readable
        spec = Path(d) / "tokenizer.json" if d else None
        if spec is not None and (not spec.is_file() or byte_level(json.loads(spec.read_text())) is None):
            other = "teacher" if section == "model" else "model"
            raise ConfigError(f"{section}.path={src.path}: its tokenizer writes tokens in a convention kdsweep cannot "
                              "read back into text (byte-level BPE and SentencePiece-style pieces can), so it cannot "
                              f"be aligned with the {other}'s; pick a {other} with the same tokenizer as the {section}")
    preflight_reads(cfg)


READ_PEEK = 8
"""Samples of the first data source the teacher reads before launch (the job reads its first rows again)."""


def preflight_reads(cfg: RunConfig) -> None:
    """The teacher reads the first samples of the data back as the same text: one line before launch for a tokenizer
    whose normalisation changes it (lowercasing, characters it has no token for)."""
    from transformers import AutoTokenizer

    from kdsweep.data.formats import FormatSpec, chat_template, check_row, render
    from kdsweep.data.sources import read_rows, train_sources
    from kdsweep.teacher.reader import RowReader, check_unchanged
    from kdsweep.teacher.views import chat_view

    where = f"teacher.path={cfg.teacher.path}" if cfg.teacher.path else f"teacher.zoo={cfg.teacher.zoo}"
    dirs = [_source(section, src)[0] or _zoo_tokenizer_dir(src.zoo) for section, src in (("model", cfg.model),
                                                                                          ("teacher", cfg.teacher))]
    student, teacher = (AutoTokenizer.from_pretrained(d) for d in dirs)
    reader = RowReader(student, teacher)
    key, ds = train_sources(cfg.data)[0]
    view = chat_view(cfg, student, lambda: teacher)  # chat: each side's own template (one line for a lossy one)
    spec = FormatSpec.of(ds, key, chat_template=chat_template(cfg.data.chat_template), add_bos=cfg.data.add_bos,
                         ignore_index=cfg.loss.ignore_index, chat_view=view)
    for i, row in enumerate(read_rows(ds.path, split=ds.split, key=f"{key}.path", limit=READ_PEEK)):
        try:
            check_row(row, spec)
        except ConfigError:  # a bad row is the data's own line, from the job that reads it
            continue
        sample = render(row, spec, student, where=f"{key}: {ds.path} row {i + 1}")  # as the job renders it
        if view is None:
            check_unchanged(reader.read([*sample.input_ids, sample.labels[-1]]), where)


def choose_impl(cfg: RunConfig) -> str:
    """``loss.impl=auto``'s choice: fused (exact, and neither model's ``[N, V]`` logits exist) unless the student or
    a live teacher transforms its logits after its output layer (:data:`LOGIT_TRANSFORMS`), then chunked; any other
    ``loss.impl`` as given."""
    if cfg.loss.impl != "auto":
        return cfg.loss.impl
    for _, view in cfg.teacher_views():
        models = [("model", view.model)] + ([("teacher", view.teacher)] if view.teacher.logits == "live" else [])
        if any(logit_transform(_source(section, source)[1]) for section, source in models):
            return "chunked"
    return "fused"


def preflight_models(cfg: RunConfig, several: bool = False) -> None:
    """Raise a ConfigError for any model problem that can be seen without loading weights (``several``: the
    teacher is one of several)."""
    s_dir, s_cfg = _source("model", cfg.model)
    t_dir, t_cfg = _source("teacher", cfg.teacher)
    for section, conf in (("model", s_cfg), ("teacher", t_cfg)):
        limit = conf.get("max_position_embeddings")
        if limit is not None and cfg.data.seq_len > limit:
            raise ConfigError(
                f"data.seq_len={cfg.data.seq_len} is beyond the {section}'s {limit} positions "
                f"(max_position_embeddings); pass data.seq_len=<at most {limit}>"
            )
        # a cached teacher's logits come from its own forward, transforms included: only live models are refused
        live = section == "model" or cfg.teacher.logits == "live"
        transform = logit_transform(conf) if cfg.loss.impl == "fused" and live else None
        if transform is not None:
            raise ConfigError(
                f"loss.impl=fused: the {section} ({', '.join(conf.get('architectures') or ['model'])}) applies "
                f"{transform[0]}={transform[1]} to its logits after the output layer, which the fused loss cannot "
                "do; use loss.impl=chunked"
            )
    from kdsweep.teacher.check import preflight_cache

    if cross_tokenizer(cfg):  # the teacher reads the same text in its own tokens (kdsweep.teacher.cross)
        check_cross_tokenizer(cfg, several)
        preflight_cache(cfg, _vocab(t_cfg) or 0, aligned=True)  # the teacher's distribution, on aligned spans
        return
    preflight_cache(cfg, min((v for v in (_vocab(s_cfg), _vocab(t_cfg)) if v), default=0))
    if s_dir is None and t_dir is None:
        return  # both from the zoo, of one tokenizer
    s_fp, s_vocab = tokenizer_fingerprint("model", s_dir or _zoo_tokenizer_dir(cfg.model.zoo))
    smallest = min(s_cfg.get("vocab_size", s_vocab), t_cfg.get("vocab_size", s_vocab))
    if s_vocab > smallest:
        raise ConfigError(
            f"the tokenizer has {s_vocab} tokens but one model's output layer has only {smallest} rows "
            "(vocab_size in config.json); the models do not match their tokenizer"
        )


def preflight_targets(cfg: RunConfig, *, zoo_too: bool = False) -> None:
    """A ConfigError when an item of ``model.target_modules`` selects no module of the student.

    Builds the student on the meta device (imports torch and transformers; no weights read), once per model and
    target list in a process. Zoo students are checked only with ``zoo_too`` (their first use builds them)."""
    if cfg.model.lora_rank == 0 or (cfg.model.path is None and not zoo_too):
        return
    if cfg.model.path is not None:
        d = hub.model_dir("model.path", cfg.model.path)
    else:
        from kdsweep.models import zoo

        d = zoo.model_dir(cfg.model.zoo)
    _check_targets(str(d), cfg.model.target_modules)


@functools.lru_cache(maxsize=32)
def _check_targets(model_dir: str, requested: tuple[str, ...]) -> None:
    from kdsweep.models.targets import check_targets

    check_targets(Path(model_dir), requested)
