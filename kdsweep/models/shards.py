"""Each rank loads its own share of a model from the safetensors files, straight into its place.

A model sharded with FSDP2 holds, on each rank, rows ``[start, stop)`` of each parameter's first dimension (its
``Shard(0)`` placement over the mesh's shard dimension, replicated across HSDP's other one); a replicated model holds
every row. Each rank reads exactly those rows of each tensor (the bytes of those rows only, with ``pread``, into its
own memory: no memory map), in the file's dtype, and copies them into its local tensor in the model's, one tensor at
a time: no rank holds a weight it does not keep beyond one parameter's rows, and no rank waits in a collective while
another reads (the ranks meet after the load, outside any collective: :func:`kdsweep.distributed.waits.together`).

What no file holds comes from the model as built on the host with empty parameters (:func:`empty`): its buffers
(rotary frequencies, Gemma's ``embed_scale``: computed from the config, as ``from_pretrained`` computes them) and what
the wrapper adds (a LoRA adapter, initialised from the seed in peft's own order: the same adapter on every rank, and
the same as one rank's).

Checkpoint names are mapped to the model's as transformers 5 maps them (its per-architecture renamings,
``transformers.conversion_mapping``). A checkpoint that needs more than renaming (fused or split tensors) or has no
safetensors files is read whole by every rank, each then keeping its rows: the same weights, with host memory for
the whole model while it loads, said in the log.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable, Iterator, Protocol

import torch
from torch import nn

from kdsweep.distributed.fsdp import hf_model

log = logging.getLogger(__name__)


class Rows(Protocol):
    """Where the weights come from: a tensor's rows ``[start, stop)`` of dimension 0 by the model's name for it."""

    def __contains__(self, name: str) -> bool: ...

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor: ...

    def files(self) -> Iterator[tuple[str, list[str]]]:
        """The names held, grouped by the file that holds them (one open file at a time)."""
        ...


DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
          "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
"""safetensors' dtype names."""


def header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (each tensor's dtype, shape and byte range) and where its data begins: the
    format's 8-byte little-endian length, then that many bytes of JSON."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), 8 + n


class SafetensorsRows:
    """The rows of the checkpoint's tensors, read from its safetensors files with ``pread`` into memory of the
    process's own, only the bytes of those rows (no memory map: a mapped file's pages would stay in the rank's
    resident memory until the file is closed)."""

    def __init__(self, model_dir: Path, names: dict[str, tuple[str, str]]) -> None:
        self.dir, self.names = model_dir, names
        """model name -> (checkpoint key, file name)."""
        self.fd, self.tensors, self.base = -1, {}, 0
        """The file being read: its descriptor, its header's tensors, where its data begins."""

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def files(self) -> Iterator[tuple[str, list[str]]]:
        by_file: dict[str, list[str]] = {}
        for name, (_, file) in self.names.items():
            by_file.setdefault(file, []).append(name)
        for file, names in sorted(by_file.items()):
            self.tensors, self.base = header(self.dir / file)
            self.fd = os.open(self.dir / file, os.O_RDONLY)
            try:
                yield file, names
            finally:
                os.close(self.fd)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        entry = self.tensors[self.names[name][0]]
        dtype, shape, (begin, end) = DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
        if not shape:
            start, stop = 0, 1
        row = (end - begin) // max(shape[0] if shape else 1, 1)
        out = torch.empty((stop - start) * row, dtype=torch.uint8)
        view, at = memoryview(out.numpy()), self.base + begin + start * row
        while len(view):  # (pread returns at most ~2 GB at a time)
            got = os.preadv(self.fd, [view], at)
            if got <= 0:
                raise OSError(f"{self.dir / self.names[name][1]} ends inside its tensor {self.names[name][0]}")
            view, at = view[got:], at + got
        return out.view(dtype).reshape(stop - start, *shape[1:]) if shape else out.view(dtype).reshape(())


class ModelRows:
    """The rows of a model's own tensors (a whole model read by ``from_pretrained``)."""

    def __init__(self, model: nn.Module) -> None:
        self.state = model.state_dict()

    def __contains__(self, name: str) -> bool:
        return name in self.state

    def files(self) -> Iterator[tuple[str, list[str]]]:
        yield "the model read whole", list(self.state)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        t = self.state[name]
        return t[start:stop] if t.dim() else t


def checkpoint_files(model_dir: Path) -> dict[str, str]:
    """Each checkpoint key of the safetensors files in ``model_dir`` -> the file holding it ({}: none)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    if (model_dir / "model.safetensors").is_file():
        return {key: "model.safetensors" for key in header(model_dir / "model.safetensors")[0] if key != "__metadata__"}
    return {}


def checkpoint_names(model: nn.Module, keys: dict[str, str]) -> tuple[dict[str, tuple[str, str]], str]:
    """Each of the transformers model ``model``'s names -> (checkpoint key, file), renamed as transformers renames
    them when it loads; and why the checkpoint cannot be read by rows ("" when it can)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    own = {name.replace(".base_layer", ""): True for name in model.state_dict()}
    names = {}
    for key, file in keys.items():
        name, converted = rename_source_key(key, renamings, converters, model.base_model_prefix, own)
        if converted is not None:
            return {}, f"its tensor {key} needs transformers' conversion {converted!r}, not only a new name"
        names[name] = (key, file)
    return names, ""


def empty(model_dir: Path, dtype: torch.dtype,
          wrap: Callable[[nn.Module], nn.Module]) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model ``wrap(...)`` makes of the one in ``model_dir``, its parameters on the meta device (ties kept), and
    by name what no file holds: its buffers (computed from the config) and the parameters ``wrap`` adds (a LoRA
    adapter, initialised as peft initialises it: ``wrap`` is applied to the model with its weights present in shape,
    each a stride-0 view of one zero that holds no memory)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.use_cache = False
    with init_empty_weights(include_buffers=False):  # parameters on the meta device, buffers computed
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # (as from_pretrained ties them once loaded: one tensor from the files for both)
    _replace(model, lambda p: torch.zeros((), dtype=p.dtype).expand(p.shape))
    weights = {id(p) for p in model.parameters()}
    model = wrap(model)
    kept = {name: p.detach().clone() for name, p in model.named_parameters() if id(p) not in weights}
    kept.update((name, b.clone()) for name, b in model.named_buffers())
    _replace(model, lambda p: torch.empty_like(p, device="meta"))
    return model, kept


def materialise(model: nn.Module, device: torch.device) -> None:
    """Give every parameter and buffer of an unsharded ``model`` uninitialised memory on ``device`` (a tied pair
    stays one tensor, which ``to_empty`` would split)."""
    _replace(model, lambda t: torch.empty_like(t, device=device), buffers=True)


def _replace(model: nn.Module, make: Callable[[torch.Tensor], torch.Tensor], buffers: bool = False) -> None:
    """Each parameter of ``model`` (and each buffer, with ``buffers``) swapped for ``make(it)``, in every module
    holding it (a tied pair stays one tensor), a parameter keeping its ``requires_grad``."""
    new: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(make(p), requires_grad=p.requires_grad)
                module._parameters[name] = new[id(p)]
        for name, b in list(module._buffers.items()) if buffers else ():
            if b is not None:
                module._buffers[name] = new.setdefault(id(b), make(b))


def rows_of(model_dir: Path, model: nn.Module, dtype: torch.dtype) -> Rows:
    """Where ``model``'s weights are read from: its safetensors files, by rows, when transformers only renames their
    tensors; else the whole model, read by every rank (said in the log)."""
    model_dir = Path(model_dir)
    keys = checkpoint_files(model_dir)
    names, why = checkpoint_names(hf_model(model), keys) if keys else ({}, "it has no safetensors files")
    if not why:
        return SafetensorsRows(model_dir, names)
    from kdsweep.models.load import read_model

    log.warning("every rank reads %s whole, then keeps its share: %s", model_dir, why)
    return ModelRows(read_model(model_dir, dtype))


def _prefix(model: nn.Module) -> str:
    """Where the transformers model sits in ``model`` ("base_model.model." in a peft model, else "")."""
    base = hf_model(model)
    return "" if base is model else next(f"{n}." for n, m in model.named_modules() if m is base)


def local_rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The tensor this rank holds of ``t``, and the rows ``[start, stop)`` of ``t``'s dimension 0 it holds (all of
    them unless ``t`` is a DTensor sharded on dimension 0 over one of its mesh's dimensions, as FSDP2 shards)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(t, DTensor):
        return t, 0, t.shape[0] if t.dim() else 0
    start, stop = 0, t.shape[0] if t.dim() else 0
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Shard) and placement.dim == 0:
            chunk = -(-t.shape[0] // t.device_mesh.size(dim))  # torch.chunk's: ceil, the last ones short or empty
            start = min(t.shape[0], t.device_mesh.get_local_rank(dim) * chunk)
            stop = min(t.shape[0], start + chunk)
        elif not isinstance(placement, Replicate):
            raise ValueError(f"cannot load a tensor placed as {placement} (kdsweep shards dimension 0 only)")
    local = t.to_local()
    if local.shape[:1] != (stop - start,) and t.dim():
        raise ValueError(f"a shard of {stop - start} rows was expected, this rank holds {tuple(local.shape)}")
    return local, start, stop


def fill(model: nn.Module, rows: Rows, kept: dict[str, torch.Tensor]) -> None:
    """Copy into each of ``model``'s tensors (materialised: sharded or whole) the rows this rank holds: a buffer or
    a wrapper's parameter from ``kept``, unless the files hold it; every weight from ``rows``. A weight neither
    holds is an error naming it, never left as garbage."""
    prefix = _prefix(model)
    tensors: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        tensors.setdefault(id(t), (t, []))[1].append(name)
    wanted: dict[str, torch.Tensor] = {}
    for t, names in tensors.values():
        own = [name.removeprefix(prefix).replace(".base_layer", "") for name in names]
        held = [o for o in own if o in rows]
        if held:
            wanted[held[0]] = t
        elif any(name in kept for name in names):
            k = kept[next(name for name in names if name in kept)]
            _copy(t, lambda start, stop, k=k: k[start:stop] if k.dim() else k)
        else:
            raise ValueError(f"{own[0]} is in no safetensors file of the model and cannot be computed; the model's "
                             f"files are incomplete (save it again with save_pretrained)")
    for _, names in rows.files():
        for name in names:
            if name in wanted:
                _copy(wanted.pop(name), lambda start, stop, n=name: rows.rows(n, start, stop))
    if wanted:
        raise RuntimeError(f"tensors the files were to hold were not read: {sorted(wanted)[:4]}")


def _copy(t: torch.Tensor, read: Callable[[int, int], torch.Tensor]) -> None:
    local, start, stop = local_rows(t)
    with torch.no_grad():
        local.copy_(read(start, stop))
