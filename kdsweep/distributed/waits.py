"""What rank 0 alone may wait on, however long it takes, while no other rank sits inside a collective.

A collective times out after ``dist.timeout_s`` (NCCL's watchdog then kills the job), so a peer must never wait in
one while rank 0 waits on something else: a file lock another job holds for hours (the teacher cache's build), the
first hash of a teacher's files, the sweep's shared baseline. :func:`from_rank0` runs such a step on rank 0 and
hands its value to the other ranks through a file in a directory every node sees (``$KDSWEEP_CACHE/rendezvous``,
which the master-port rendezvous already needs shared), which they poll: a file wait has no timeout, and each
waiting rank says in its log, every minute, what it waits for. Rank 0 keeps a heartbeat beside the file while it
works, so a peer whose rank 0 vanished without its launcher ending the job says so instead of waiting forever.

Every rank calls :func:`from_rank0` at the same points in the same order, as it would a collective; each call has
its own file, numbered within the process group (:func:`begin`, with a token rank 0 chose when the group formed).

One rank per node reads the shared directory; its node's other ranks wait on it locally. Rank 0 writes its word to
the shared file and to a copy in its own node's local directory (:func:`node_root`: ``/dev/shm``, every process of a
node sees it); on every other node, the node's first rank polls the shared file, backing off to one look a second
(:data:`SHARED_POLL_S`), and copies the word into its node's local directory, where the node's other ranks poll it
(:data:`LOCAL_POLL_S`), looking at the shared file too every :data:`FALLBACK_S` (so a node whose copy never comes
still hears rank 0). So a job of N nodes that waits makes about 2·(N−1) metadata operations a second on the shared
filesystem, plus one per waiting rank every 10 s, however many ranks each node has (it was two per waiting rank every
50 ms). Ranks that do not split evenly into nodes each poll the shared file.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, TypeVar

from kdsweep.distributed.env import DistEnv

log = logging.getLogger(__name__)

T = TypeVar("T")
SAY_EVERY_S = float(os.environ.get("KDSWEEP_WAIT_SAY_S") or 60.0)
"""How often a waiting rank logs what it waits for (``KDSWEEP_WAIT_SAY_S``, default a minute)."""
BEAT_S = 5.0
STALE_S = 120.0
"""A heartbeat unchanged for this long (by the waiting rank's own clock): rank 0 is gone."""
SHARED_POLL_S = 1.0
"""The longest pause between two looks at the shared directory (backing off from 2 ms)."""
LOCAL_POLL_S = 0.05
"""The longest pause between two looks at a node's local copy."""
FALLBACK_S = 10.0
"""How often a rank waiting on its node's copy also looks at the shared file."""
NODE_DIR_ENV = "KDSWEEP_NODE_TMP"


class _Group:
    token: str | None = None
    seq: int = 0
    root: Path | None = None
    local: Path | None = None
    """This node's local directory (None: the ranks do not split evenly into nodes, each reads the shared one)."""


_GROUP = _Group()


def rendezvous_root() -> Path:
    from kdsweep.data.cache import kdsweep_cache

    return kdsweep_cache() / "rendezvous"


def begin(env: DistEnv) -> None:
    """A process group formed: rank 0 names its waits' directory (a collective, while every rank has just joined)."""
    _GROUP.token = env.broadcast_object(uuid.uuid4().hex if env.is_main else None)
    _GROUP.seq, _GROUP.root = 0, rendezvous_root() / f"waits-{_GROUP.token}"
    even = env.local_world_size > 1 and env.world_size % env.local_world_size == 0
    _GROUP.local = node_root() / f"kdsweep-waits-{_GROUP.token}-node{env.node}" if even else None
    if env.is_main:
        _GROUP.root.mkdir(parents=True, exist_ok=True)
    if _GROUP.local is not None and _node_first(env):  # the rank that writes its node's copies
        _GROUP.local.mkdir(parents=True, exist_ok=True)


def node_root() -> Path:
    """Where a node's ranks hand rank 0's word on: ``$KDSWEEP_NODE_TMP``, else ``/dev/shm`` (a node's own memory,
    seen by every process of the node whatever its ``$TMPDIR``), else the temp directory."""
    if os.environ.get(NODE_DIR_ENV):
        return Path(os.environ[NODE_DIR_ENV])
    return Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())


def _node_first(env: DistEnv) -> bool:
    """Whether this rank reads the shared directory for its node (and writes the node's local copy)."""
    return _GROUP.local is None or env.rank == env.node * env.local_world_size


def end(env: DistEnv) -> None:
    """The process group is ending (every rank past its last wait): rank 0 removes the waits' files, and each node's
    first rank its node's local copies."""
    if env.is_main and _GROUP.root is not None:
        shutil.rmtree(_GROUP.root, ignore_errors=True)
    if _GROUP.local is not None and _node_first(env):
        shutil.rmtree(_GROUP.local, ignore_errors=True)
    _GROUP.token, _GROUP.root, _GROUP.local = None, None, None


class _Heartbeat:
    """Rank 0's heartbeat while it works: ``paths`` (the shared file, and its node's local copy) rewritten every
    :data:`BEAT_S`."""

    def __init__(self, *paths: Path) -> None:
        self.paths, self.stopped = paths, threading.Event()
        for path in paths:
            path.touch()
        self.thread = threading.Thread(target=self._beat, daemon=True, name="kdsweep-rank0-heartbeat")
        self.thread.start()

    def _beat(self) -> None:
        while not self.stopped.wait(BEAT_S):
            for path in self.paths:
                try:
                    path.write_text(str(time.time()))
                except OSError:
                    pass

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


def _write_atomic(path: Path | None, payload: Any) -> None:
    if path is None:
        return
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_bytes(pickle.dumps(payload))
    os.replace(tmp, path)


def from_rank0(env: DistEnv, what: str, fn: Callable[[], T]) -> T:
    """``fn()`` computed on rank 0 (taking as long as it takes), its value on every rank, with no rank inside a
    collective meanwhile. ``what`` says what rank 0 does, for the waiting ranks' log lines ("hash the teacher's
    files"). An error on rank 0 is raised on every rank."""
    if not env.active:
        return fn()
    if _GROUP.root is None:  # a process group kdsweep did not form itself (a test's, a harness's): named now
        begin(env)
    _GROUP.seq += 1
    path = _GROUP.root / f"{_GROUP.seq}.pickle"
    beat = path.with_suffix(".alive")
    local = _GROUP.local / path.name if _GROUP.local is not None else None
    local_beat = local.with_suffix(".alive") if local is not None else None
    if env.is_main:
        heart = _Heartbeat(beat, *([local_beat] if local_beat is not None else []))
        try:
            value = fn()
        except BaseException as e:
            for where in (path, local):
                _write_atomic(where, ("error", f"{type(e).__name__}: {e}"))
            raise
        finally:
            heart.stop()
        for where in (path, local):
            _write_atomic(where, ("ok", value))
        return value
    if _node_first(env):  # its node's reader of the shared directory: it hands the word on to its node
        try:
            word = _wait(env, path, beat, what, SHARED_POLL_S)
        except RuntimeError as e:  # rank 0 is gone: the node's other ranks hear it too
            _write_atomic(local, ("gone", str(e)))
            raise
        _write_atomic(local, word)
    else:
        word = _wait(env, local, local_beat, what, LOCAL_POLL_S, fallback=path)
    status, value = word
    if status == "error":
        raise RuntimeError(f"rank 0 failed to {what}: {value}")
    if status == "gone":
        raise RuntimeError(value)
    return value


def together(env: DistEnv, what: str) -> None:
    """Every rank past this point before any rank goes on, with no rank inside a collective meanwhile (the end of a
    step each rank takes alone, as long as it takes: reading its share of a model). Each rank leaves a mark in the
    shared directory; rank 0 waits until it has every rank's (looking at the directory with pauses backing off to
    :data:`SHARED_POLL_S`), then says so to all as :func:`from_rank0` does. Every rank calls it alike."""
    if not env.active:
        return
    if _GROUP.root is None:
        begin(env)
    mark = f"{_GROUP.seq + 1}.done"  # the number from_rank0 gives this wait
    if not env.is_main:  # (rank 0 may not have made the directory yet)
        _GROUP.root.mkdir(parents=True, exist_ok=True)
        (_GROUP.root / f"{mark}.{env.rank}").touch()

    def every_rank() -> None:
        began = last_said = time.time()
        pause = 0.002
        while len(list(_GROUP.root.glob(f"{mark}.*"))) < env.world_size - 1:
            time.sleep(pause)
            pause = min(pause * 2, SHARED_POLL_S)
            if time.time() - last_said >= SAY_EVERY_S:
                last_said = time.time()
                done = {p.name.rsplit(".", 1)[1] for p in _GROUP.root.glob(f"{mark}.*")}
                waiting = [r for r in range(1, env.world_size) if str(r) not in done]
                log.info("rank 0: waiting %.0f s so far for ranks %s to %s", time.time() - began, waiting[:8], what)

    from_rank0(env, f"see every rank {what}", every_rank)


def _wait(env: DistEnv, path: Path, beat: Path, what: str, longest: float,
          fallback: Path | None = None) -> tuple[str, Any]:
    """Rank 0's word from ``path`` (or from ``fallback``, looked at every :data:`FALLBACK_S`), looked for with pauses
    from 2 ms doubling to ``longest``; a RuntimeError if rank 0's heartbeat ``beat`` (when this node has one) stops
    changing."""
    began = last_said = last_fallback = time.time()
    pause, seen, seen_at = 0.002, None, time.time()
    while not path.exists():
        time.sleep(pause)
        pause = min(pause * 2, longest)
        now = time.time()
        if fallback is not None and now - last_fallback >= FALLBACK_S:
            last_fallback = now
            if fallback.exists():  # this node's copy is late (or its first rank is gone): rank 0's own word
                return pickle.loads(fallback.read_bytes())
        try:
            mark = beat.stat().st_mtime_ns
        except FileNotFoundError:
            mark = None  # rank 0 has not reached this wait yet (or another node's rank 0 beats elsewhere)
        if mark != seen:
            seen, seen_at = mark, now
        elif mark is not None and now - seen_at > STALE_S and not path.exists():
            raise RuntimeError(f"rank 0 stopped answering while it was to {what} (its heartbeat {beat} has not "
                               f"changed for {now - seen_at:.0f} s)")
        if now - last_said >= SAY_EVERY_S:
            last_said = now
            log.info("rank %d: waiting %.0f s so far for rank 0 to %s", env.rank, now - began, what)
    return pickle.loads(path.read_bytes())
