"""The embedded zoo kept between CI runs on one machine (``KDSWEEP_ZOO_STORE``, set by .ci/run).

Pre-training the zoo is the same four CPU-minutes in every CI run: two teachers of 400 steps and a student of 150,
bit for bit the same each time. A session that finds them in the store under its key starts from them; a session
that built them leaves them there. The key is everything that decides the bytes: the code that builds them
(``kdsweep/models/zoo.py`` and ``kdsweep/data/``, which it imports), the embedded corpus, the packages that train
and save them, the Python and the machine. A change to any of these builds the zoo again, in that run.

The zoo's own key (kdsweep.models.zoo) does not cover its code, on purpose: a user's cache keeps its models across
kdsweep releases until ZOO_VERSION changes. CI must see a change to the code at once, hence this key.
The build itself is still exercised in every run: tests/unit/test_zoo.py pre-trains each model through the same
code at a two-step recipe, and builds the tokenizers from scratch.
"""

from __future__ import annotations

import hashlib
import platform
import shutil
import sys
from importlib import metadata
from pathlib import Path

from kdsweep.data.cache import built_once

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors")
ENTRIES = ("tokenizer", "tiny-")  # what the zoo builds: its tokenizers and its models, each a directory


def key(repo: Path = REPO) -> str:
    """The hash of what decides the zoo's bytes."""
    from kdsweep.data.text import EMBEDDED_CORPUS

    h = hashlib.sha256()
    for path in [repo / "kdsweep" / "models" / "zoo.py", *sorted((repo / "kdsweep" / "data").glob("*.py")),
                 EMBEDDED_CORPUS]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(repr([(p, metadata.version(p)) for p in PACKAGES]).encode())
    h.update(f"{sys.version_info[:2]} {platform.machine()}".encode())
    return h.hexdigest()[:16]


def _entries(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and p.name.startswith(ENTRIES))


def _copy(src: Path, into: Path) -> None:
    """``src`` into ``into`` (unless it is there), appearing whole by a rename, as the zoo's own builds appear."""
    with built_once(into, src.name) as (_, tmp):
        if tmp is not None:
            shutil.copytree(src, tmp, dirs_exist_ok=True)


def restore(store: Path, zoo: Path) -> list[str]:
    """Copy the store's zoo for this key into the cache's zoo directory; the names copied."""
    found = _entries(store / key())
    for entry in found:
        _copy(entry, zoo)
    return [p.name for p in found]


def save(store: Path, zoo: Path) -> list[str]:
    """Keep what the cache's zoo holds that the store lacks for this key, and only this key's zoo; the names
    kept."""
    into = store / key()
    into.mkdir(parents=True, exist_ok=True)  # (built_once makes it too, but only when there is something to keep)
    for old in store.iterdir():  # a zoo no run of this code and these packages builds again
        if old != into and not old.name.startswith("."):
            shutil.rmtree(old, ignore_errors=True)
    new = [p for p in _entries(zoo) if not (into / p.name).exists()]
    for entry in new:
        _copy(entry, into)
    return [p.name for p in new]
