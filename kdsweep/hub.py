"""Hugging Face hub ids (``org/name`` or ``org/name@revision``) as model paths, resolved through the local HF cache.

A model path that is not a local directory but reads like a hub id is looked up the way transformers does: in
the hub cache (``HF_HUB_CACHE``, by default ``$HF_HOME/hub``), the snapshot of ``revision`` (a branch, a tag or a
commit; ``main`` by default). The process that launches a job resolves it once (``download=True``), before any
rank or SLURM task starts: from the cache, or, when the hub is reachable and ``HF_HUB_OFFLINE`` is not set, by
downloading the model's config, weights and tokenizer into the cache. Ranks and tasks then only read the cache
(``download=False``), so a cluster node needs no network. Pure Python: huggingface_hub is imported lazily.
"""

from __future__ import annotations

import re
from pathlib import Path

from kdsweep.config.schema import ConfigError

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
# What a causal LM needs from its repository: never the original/ checkpoints, GGUF or ONNX exports beside it.
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


def hub_id(ref: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``ref`` names no local path and reads like a hub id, else None."""
    match = HUB_ID.match(ref)
    if match is None or Path(ref).exists():
        return None
    return match["repo"], match["revision"]


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def fill_hint(repo: str, revision: str | None) -> str:
    """The command that puts ``repo`` into the cache on a machine with network."""
    return f"hf download {repo}" + (f" --revision {revision}" if revision else "")


def model_dir(key: str, ref: str, *, download: bool = False) -> Path:
    """The local directory of the model at ``ref`` (the config key ``key`` names it in errors).

    A local path is returned as it is (its checks come later); a hub id becomes its cached snapshot. With
    ``download`` and the hub reachable, a model missing from the cache is downloaded first.
    """
    parsed = hub_id(ref)
    if parsed is None:
        return Path(ref)
    repo, revision = parsed
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        if not download or offline():
            why = "HF_HUB_OFFLINE=1 forbids downloading" if offline() else "ranks only read the cache"
            raise ConfigError(
                f"{key}={ref} is neither a local directory nor in the Hugging Face cache {cache_dir()} ({why}); "
                f"fill the cache on a machine with "
                f"network ({fill_hint(repo, revision)}) and point HF_HOME at it, or pass {key}=<a local HF model "
                "directory>"
            ) from None
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=MODEL_FILES))
    except Exception as e:  # noqa: BLE001 (network, auth, a gated or missing repo: one line either way)
        raise ConfigError(
            f"{key}={ref} could not be downloaded into {cache_dir()} ({' '.join(str(e).split())[:200]}); fill the "
            f"cache with {fill_hint(repo, revision)}, or pass {key}=<a local HF model directory>"
        ) from None
