"""The embedded zoo builds deterministically, caches by content, and survives concurrent builders."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from kdsweep.models import zoo

BUILD = "from kdsweep.models import zoo; print(zoo.tokenizer_dir())"


def build_in(cache: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUILD], env={**os.environ, "KDSWEEP_CACHE": str(cache)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def digest(d: Path) -> str:
    return hashlib.sha256((d / "tokenizer.json").read_bytes()).hexdigest()


def test_tokenizer_is_deterministic_and_concurrent_builds_agree(tmp_path):
    a, b = build_in(tmp_path / "one"), build_in(tmp_path / "one")  # two builders racing on one cache
    c = build_in(tmp_path / "two")
    outs = [p.communicate()[0].strip() for p in (a, b, c)]
    assert all(p.returncode == 0 for p in (a, b, c))
    assert outs[0] == outs[1]
    assert [p.name for p in (tmp_path / "one" / "zoo").iterdir() if not p.name.startswith(".")] == [Path(outs[0]).name]
    assert digest(Path(outs[0])) == digest(Path(outs[2]))  # same inputs, same tokenizer, bit for bit
    assert Path(outs[0]).name == Path(outs[2]).name  # the directory name is the content key


def test_cache_key_covers_the_corpus_and_the_recipe(tmp_path, monkeypatch):
    """The key changes with the recipe and with the corpus' content, so a stale model is never reused."""
    key = zoo._digest(zoo.ARCHS["tiny-teacher"], zoo.RECIPES["tiny-teacher"])
    assert zoo._digest(zoo.ARCHS["tiny-teacher"], {**zoo.RECIPES["tiny-teacher"], "steps": 1}) != key
    corpus = tmp_path / "kjv.txt"
    corpus.write_bytes(zoo.EMBEDDED_CORPUS.read_bytes() + b"one more document\n")
    monkeypatch.setattr(zoo, "EMBEDDED_CORPUS", corpus)
    assert zoo._digest(zoo.ARCHS["tiny-teacher"], zoo.RECIPES["tiny-teacher"]) != key
