"""Plain (already resolved) dict → :class:`RunConfig`, once, with one clear line for every mistake."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from kdsweep.config.schema import ConfigError, RunConfig

# Top-level sweep knobs: the config tree interpolates them into their sections (loss.kd_ratio, optim.lr,
# model.lora_rank, rollout.lmbda), so the typed config holds each value in exactly one place.
SWEEP_KNOBS = ("kd_ratio", "lr", "lora_rank", "lmbda")
KNOB_TARGETS = {"kd_ratio": ("loss", "kd_ratio"), "lr": ("optim", "lr"), "lora_rank": ("model", "lora_rank"),
                "lmbda": ("rollout", "lmbda")}
LISTS = ("teachers",)
"""Top-level keys of the run config that are neither a group nor a knob: set whole (``teachers=[...]``)."""
# Keys the Hydra app adds beside the run config; they are not part of it.
IGNORED_KEYS = ("hydra",)
REMOVED = {
    "dist.mixed_precision": "train.dtype=bf16 is bf16 compute with fp32 master weights, on one rank and on many "
                            "(pass train.dtype=bf16; bf16_pure for bf16 weights)",
    "loss.num_chunks": "the loss splits into as many chunks as loss.chunk_mb (MiB of one [chunk, vocabulary] fp32 "
                       "buffer) asks; pass loss.chunk_mb=<MiB> (smaller: more chunks), or loss.impl=dense for one",
}
"""Keys that were removed: what to pass instead."""


def _removed(key: str) -> None:
    if key in REMOVED:
        raise ConfigError(f"{key} was removed: {REMOVED[key]}")


def to_run_config(raw: dict[str, Any]) -> RunConfig:
    """Build and validate the typed config from a resolved, plain dict (no interpolations left)."""
    body = {k: v for k, v in raw.items() if k not in SWEEP_KNOBS and k not in IGNORED_KEYS}
    cfg = _build(RunConfig, body, prefix="")
    for knob, (section, name) in KNOB_TARGETS.items():
        if knob in raw and raw[knob] != getattr(getattr(cfg, section), name):
            # A section value that ignores the knob would make a sweep over the knob run identical jobs.
            raise ConfigError(
                f"{section}.{name}={getattr(getattr(cfg, section), name)} disagrees with the sweep knob "
                f"{knob}={raw[knob]}; "
                f"set {knob}=... (the sections take it by interpolation) instead of {section}.{name}"
            )
    return cfg


def _build(cls: type, values: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the config"
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a mapping of fields, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    for name in unknown:
        _removed(f"{prefix}{name}")
    if unknown:
        known = ", ".join(sorted(fields))
        raise ConfigError(f"unknown config key '{prefix}{unknown[0]}'; valid keys of {where}: {known}")
    kwargs = {name: _coerce(hints[name], value, f"{prefix}{name}") for name, value in values.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{where}: {e}") from None


def _coerce(hint: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, prefix=key + ".")
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, key)
    if origin is tuple:
        if isinstance(value, str) and args == (str, Ellipsis):  # a list of names given as one name
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} must be a list, e.g. {key}=[a,b]")
        item = args[0]
        items = tuple(_coerce(item, v, f"{key}[{i}]" if dataclasses.is_dataclass(item) else key)
                      for i, v in enumerate(value))
        if args[-1] is not Ellipsis and len(items) != len(args):
            raise ConfigError(f"{key}={list(value)} must have {len(args)} values")
        return items
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r} must be an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} must be a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r} must be a string")
        return value
    raise TypeError(f"unsupported config type {hint!r} for {key}")  # a schema bug, not a user error


def check_key(key: str, groups: tuple[str, ...]) -> None:
    """Raise a ConfigError when a dotted command-line key names no field (``train.foo``, ``lr_rate``)."""
    _removed(key)
    head, *rest = key.split(".")
    if head in groups and not rest:
        return  # a group choice such as model=tiny
    if not rest:
        if head not in SWEEP_KNOBS and head not in groups and head not in LISTS:
            valid = ", ".join([*SWEEP_KNOBS, *LISTS, *groups])
            raise ConfigError(f"unknown config key '{key}'; top-level keys are: {valid}")
        return
    cls: Any = RunConfig
    for i, part in enumerate([head, *rest]):
        if typing.get_origin(cls) is tuple and part.isdigit():  # data.datasets.0.path: an item of a list of sections
            cls = typing.get_args(cls)[0]
            continue
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if part not in fields:
            where = ".".join([head, *rest][:i]) or "the config"
            raise ConfigError(f"unknown config key '{key}'; valid keys of {where}: {', '.join(sorted(fields))}")
        cls = typing.get_type_hints(cls)[part]
