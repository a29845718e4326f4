"""Every collective a rank issues, counted by the model whose weights it moves and by its kind, in bytes per rank.

Counting wraps torch.distributed's collectives (and the functional ones DTensor issues, e.g. for the gradient norm),
once per process, when a job's process group is joined (:func:`install`). The wrappers see what is actually issued:
FSDP2's all-gathers and reduce-scatters, HSDP's all-reduce across nodes, the loop's own reductions, broadcasts
and barriers. A model is named as the owner of its FSDP2 collectives through FSDP's own custom-comm hooks
(:func:`label`: each of its FSDP units all-gathers and reduce-scatters through a comm that names it); a group
registered by :func:`own_group` (HSDP's replicate group) makes its all-reduces the model's. Everything else is
``other``: token counts, loss and evaluation sums, the gradient norm, stop decisions, checkpoint barriers, object
broadcasts.

Bytes per rank follow the ring algorithms NCCL uses for large messages, for a group of ``n`` ranks: an all-gather
receives ``(n-1)/n`` of its output (a functional all-gather's output is ``n`` times the shard it is given), a
reduce-scatter ``(n-1)/n`` of its input, an all-reduce ``2(n-1)/n`` of its tensor, an all-to-all sends ``(n-1)/n``
of its input, a broadcast its tensor on every rank but the source, a barrier nothing. The rooted ones move each
rank's tensor directly: a gather's, a scatter's or a reduce's root ``n-1`` tensors, every other rank its one; a send
or a receive its tensor. The object collectives (``gather_object``, ``broadcast_object_list``, ...) are counted as
the tensor collectives they issue. ``cross_node_bytes`` are those of
collectives whose group spans more than one node (what may cross the network between nodes).

Once a collective raised (a peer is gone; a functional collective raises when its result is waited on) or the
process marked itself failed (:func:`mark_failed`), every later collective raises at once instead of waiting on peers
that will never come: no rank enters a collective after a failure it knows of.

``KDSWEEP_COLLECTIVE_LOG=<dir>``: each rank also appends every collective it issues to ``<dir>/rank<r>-<pid>.jsonl``
(``{"t", "kind", "owner", "n", "phase": "start"|"end"|"error"}``), to show which collectives ran after a failure.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

LOG_ENV = "KDSWEEP_COLLECTIVE_LOG"
OTHER = "other"
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "gather", "scatter", "reduce", "send",
         "recv", "barrier")

_OWNER: contextvars.ContextVar[str | None] = contextvars.ContextVar("kdsweep_comm_owner", default=None)
_GROUP_OWNERS: dict[int, str] = {}
_inside = threading.local()


class CollectiveRefused(RuntimeError):
    """A collective asked for after this process knew a rank had failed."""


@dataclass
class Tally:
    """Calls, bytes per rank and cross-node bytes, per (owner, kind)."""

    counts: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def add(self, owner: str, kind: str, nbytes: float, cross_node: bool) -> None:
        c = self.counts.setdefault((owner, kind), [0, 0.0, 0.0])
        c[0] += 1
        c[1] += nbytes
        c[2] += nbytes if cross_node else 0.0

    def copy(self) -> "Tally":
        return Tally({k: list(v) for k, v in self.counts.items()})

    def since(self, earlier: "Tally") -> "Tally":
        """What was counted after ``earlier`` (a :meth:`copy` of this tally)."""
        out = Tally()
        for key, (calls, nbytes, cross) in self.counts.items():
            c0, b0, x0 = earlier.counts.get(key, (0, 0.0, 0.0))
            if calls - c0:
                out.counts[key] = [calls - c0, nbytes - b0, cross - x0]
        return out

    def __add__(self, other: "Tally") -> "Tally":
        out = self.copy()
        for key, (calls, nbytes, cross) in other.counts.items():
            c = out.counts.setdefault(key, [0, 0.0, 0.0])
            c[0], c[1], c[2] = c[0] + calls, c[1] + nbytes, c[2] + cross
        return out

    def record(self) -> dict[str, dict[str, dict[str, float]]]:
        """``{owner: {kind: {"calls", "bytes", "cross_node_bytes"}}}`` (run.json's ``comm``)."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (owner, kind), (calls, nbytes, cross) in sorted(self.counts.items()):
            out.setdefault(owner, {})[kind] = {"calls": int(calls), "bytes": int(round(nbytes)),
                                               "cross_node_bytes": int(round(cross))}
        return out

    def row(self) -> dict[str, float]:
        """``{"comm/<owner>/<kind>": bytes}`` (a metrics row's scalars)."""
        return {f"comm/{owner}/{kind}": int(round(nbytes))
                for (owner, kind), (_, nbytes, _) in sorted(self.counts.items())}


TALLY = Tally()
"""This process's count since :func:`install` (a job or worker takes copies and differences of it)."""


@dataclass
class _State:
    installed: bool = False
    ranks_per_node: int = 1
    failed: str | None = None
    collective_error: str | None = None
    log: Any = None


_STATE = _State()


def _group_ranks(group: Any) -> list[int]:
    import torch.distributed as dist

    try:
        return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    except (RuntimeError, ValueError):
        return []


@functools.lru_cache(maxsize=256)
def _shape_of(group_key: int, ranks: tuple[int, ...], per_node: int) -> tuple[int, bool]:
    return len(ranks), len({r // per_node for r in ranks}) > 1


def _group_shape(group: Any) -> tuple[int, bool]:
    """(ranks in the group, whether they span several nodes)."""
    ranks = tuple(_group_ranks(group))
    return _shape_of(id(group), ranks, max(_STATE.ranks_per_node, 1)) if ranks else (1, False)


def nbytes(t: Any) -> int:
    """Bytes of the tensors in ``t`` (a tensor, or lists, tuples and dicts of them; a DTensor: this rank's shard)."""
    if isinstance(t, torch.Tensor):
        local = getattr(t, "_local_tensor", t)
        return local.numel() * local.element_size()
    if isinstance(t, dict):
        return sum(nbytes(x) for x in t.values())
    if isinstance(t, (list, tuple)):
        return sum(nbytes(x) for x in t)
    return 0


def _wire(kind: str, payload: int, n: int, is_root: bool = False) -> float:
    """Bytes one rank moves for a collective of ``payload`` bytes over ``n`` ranks (the module's docstring)."""
    if n <= 1:
        return 0.0
    share = (n - 1) / n
    rooted = (n - 1) * payload if is_root else float(payload)
    return {"all_gather": payload * share, "reduce_scatter": payload * share, "all_reduce": 2 * payload * share,
            "all_to_all": payload * share, "broadcast": 0.0 if is_root else float(payload), "gather": rooted,
            "scatter": rooted, "reduce": rooted, "send": float(payload), "recv": float(payload),
            "barrier": 0.0}[kind]


def _log(entry: dict[str, Any]) -> None:
    if _STATE.log is not None:
        _STATE.log.write(json.dumps(entry) + "\n")
        _STATE.log.flush()


def _counted(kind: str, fn: Callable, payload: Callable[[inspect.BoundArguments], Any],
             functional: bool = False) -> Callable:
    """``fn`` that counts itself (the outermost call only: c10d's functions call each other)."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "depth", 0):
            return fn(*args, **kwargs)
        if _STATE.failed is not None:
            raise CollectiveRefused(f"no {kind} after a failure: {_STATE.failed}")
        bound = sig.bind(*args, **kwargs)
        group = bound.arguments.get("group")
        if functional:
            group = _functional_group(group)
        n, cross = _group_shape(group)
        owner = _OWNER.get() or (_GROUP_OWNERS.get(id(group)) if kind == "all_reduce" else None) or OTHER
        size = nbytes(payload(bound)) * (n if functional and kind == "all_gather" else 1)  # its shard: n of them
        TALLY.add(owner, kind, _wire(kind, size, n, kind in ROOTED and _is_root(bound, group)), cross)
        entry = {"t": time.time(), "kind": kind, "owner": owner, "n": n}
        _log({**entry, "phase": "start"})
        _inside.depth = 1
        try:
            out = fn(*args, **kwargs)
        except BaseException as e:
            _STATE.failed = _STATE.collective_error = f"{kind} failed ({type(e).__name__}: {str(e)[:200]})"
            _log({**entry, "t": time.time(), "phase": "error"})
            raise
        finally:
            _inside.depth = 0
        _log({**entry, "t": time.time(), "phase": "end"})
        return out

    return wrapper


ROOTED = ("broadcast", "gather", "scatter", "reduce")
"""The collectives with a root (``src`` or ``dst``, or their ``group_`` forms: a rank within the group)."""


def _is_root(bound: inspect.BoundArguments, group: Any) -> bool:
    import torch.distributed as dist

    args = bound.arguments
    root = args.get("src", args.get("dst"))
    if root is None:
        group_root = args.get("group_src", args.get("group_dst")) or 0
        return dist.get_rank(group) == group_root if group is not None else dist.get_rank() == group_root
    return dist.get_rank() == root


def _functional_group(group: Any) -> Any:
    """The ProcessGroup of a functional collective's group argument (a mesh and dim, ranks, a name)."""
    try:
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(funcol._resolve_group_name(group))
    except Exception:  # noqa: BLE001  an unusual group form: counted over the whole world
        return None


_C10D = {
    "all_gather_single": ("all_gather", lambda b: b.arguments["output_tensor"]),
    "all_gather_into_tensor": ("all_gather", lambda b: b.arguments["output_tensor"]),
    "all_gather": ("all_gather", lambda b: b.arguments["tensor_list"]),
    "reduce_scatter_single": ("reduce_scatter", lambda b: b.arguments["input"]),
    "reduce_scatter_tensor": ("reduce_scatter", lambda b: b.arguments["input"]),
    "reduce_scatter": ("reduce_scatter", lambda b: b.arguments["input_list"]),
    "all_reduce": ("all_reduce", lambda b: b.arguments["tensor"]),
    "all_reduce_coalesced": ("all_reduce", lambda b: b.arguments["tensors"]),
    "all_to_all": ("all_to_all", lambda b: b.arguments["input_tensor_list"]),
    "all_to_all_single": ("all_to_all", lambda b: b.arguments["input"]),
    "broadcast": ("broadcast", lambda b: b.arguments["tensor"]),
    "gather": ("gather", lambda b: b.arguments["tensor"]),
    "scatter": ("scatter", lambda b: b.arguments["tensor"]),
    "reduce": ("reduce", lambda b: b.arguments["tensor"]),
    "send": ("send", lambda b: b.arguments["tensor"]),
    "isend": ("send", lambda b: b.arguments["tensor"]),
    "recv": ("recv", lambda b: b.arguments["tensor"]),
    "irecv": ("recv", lambda b: b.arguments["tensor"]),
    "barrier": ("barrier", lambda b: None),
    "monitored_barrier": ("barrier", lambda b: None),
}
_FUNCTIONAL = {
    "all_reduce": "all_reduce", "all_gather_single": "all_gather", "all_gather_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter", "broadcast": "broadcast",
    "all_to_all_single": "all_to_all",
}


def install(ranks_per_node: int, rank: int) -> None:
    """Count every collective of this process from now on (idempotent; a new job resets the failure mark)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    _STATE.ranks_per_node, _STATE.failed, _STATE.collective_error = max(ranks_per_node, 1), None, None
    _shape_of.cache_clear()
    where = os.environ.get(LOG_ENV)
    if where and _STATE.log is None:
        Path(where).mkdir(parents=True, exist_ok=True)
        _STATE.log = open(Path(where) / f"rank{rank}-{os.getpid()}.jsonl", "a", buffering=1)
    if _STATE.installed:
        return
    _STATE.installed = True
    for name, (kind, payload) in _C10D.items():
        original = getattr(c10d, name, None)
        if original is None:
            continue
        wrapped = _counted(kind, original, payload)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)
    for name, kind in _FUNCTIONAL.items():
        original = getattr(funcol, name, None)
        if original is not None:
            setattr(funcol, name, _counted(kind, original, lambda b: b.arguments["self"], functional=True))
    if getattr(funcol, "wait_tensor", None) is not None:
        funcol.wait_tensor = _waited(funcol.wait_tensor)


def _waited(fn: Callable) -> Callable:
    """The wait of a functional collective's result, which raises the collective's error (it runs asynchronously:
    its call returned long before), marking the process failed as a collective's own error does."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BaseException as e:
            _STATE.failed = _STATE.collective_error = (f"a functional collective failed when waited on "
                                                       f"({type(e).__name__}: {str(e)[:200]})")
            _log({"t": time.time(), "kind": "wait", "owner": OTHER, "n": 0, "phase": "error"})
            raise

    return wrapper


def mark_failed(reason: str) -> None:
    """This process knows a rank failed: from now on every collective raises :class:`CollectiveRefused`."""
    _STATE.failed = reason
    _log({"t": time.time(), "kind": "failure", "owner": OTHER, "n": 0, "phase": "failed", "reason": reason[:300]})


def failed() -> str | None:
    """Why this process stopped issuing collectives (None while it has not)."""
    return _STATE.failed


def collective_error() -> str | None:
    """The collective that raised in this process, if one did (its peers are gone or stuck)."""
    return _STATE.collective_error


@contextlib.contextmanager
def owned_by(owner: str) -> Iterator[None]:
    """Collectives issued in the block count as ``owner``'s."""
    token = _OWNER.set(owner)
    try:
        yield
    finally:
        _OWNER.reset(token)


def own_group(group: Any, owner: str) -> None:
    """The all-reduces of ``group`` count as ``owner``'s (HSDP's all-reduce of gradients across nodes)."""
    _GROUP_OWNERS[id(group)] = owner


def label(model: torch.nn.Module, owner: str) -> None:
    """Name ``owner`` on every all-gather and reduce-scatter of ``model``'s FSDP2 units (FSDP's custom-comm hooks)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class AllGather(DefaultAllGather):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with owned_by(owner):
                return super().__call__(*args, **kwargs)

    class ReduceScatter(DefaultReduceScatter):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with owned_by(owner):
                return super().__call__(*args, **kwargs)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(AllGather())
            module.set_custom_reduce_scatter(ReduceScatter())


def read_log(path: Path) -> list[dict[str, Any]]:
    """The entries of one rank's collective log (:data:`LOG_ENV`)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
