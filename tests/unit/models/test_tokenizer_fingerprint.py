"""A tokenizer's fingerprint (the check that tells a teacher of another tokenizer apart) is read once per file and
content in a process, and read again when the file changes."""

from __future__ import annotations

import json
import os

import pytest

from kdsweep.config.schema import ConfigError
from kdsweep.models import check


def save(d, vocab: dict[str, int], added=()):
    d.mkdir(parents=True, exist_ok=True)
    tok = {"model": {"type": "BPE", "vocab": vocab}, "added_tokens": [{"content": c, "id": i} for c, i in added]}
    (d / "tokenizer.json").write_text(json.dumps(tok))
    return str(d)


@pytest.fixture
def parses(monkeypatch):
    calls = []
    real = check._vocab_fingerprint
    monkeypatch.setattr(check, "_vocab_fingerprint", lambda raw: calls.append(1) or real(raw))
    return calls


def test_one_parse_per_content_and_a_changed_file_is_read_again(tmp_path, parses):
    a = save(tmp_path / "a", {"x": 0, "y": 1}, added=[("<s>", 2)])
    b = save(tmp_path / "b", {"x": 0, "y": 1}, added=[("<s>", 2)])  # another model of one family: the same file
    first = check.tokenizer_fingerprint("model", a)
    assert first[1] == 3
    assert check.tokenizer_fingerprint("model", a) == first == check.tokenizer_fingerprint("teacher", b)
    assert len(parses) == 1
    save(tmp_path / "a", {"x": 0, "z": 1}, added=[("<s>", 2)])  # the same size, rewritten in place
    st = os.stat(tmp_path / "a" / "tokenizer.json")
    os.utime(tmp_path / "a" / "tokenizer.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    changed = check.tokenizer_fingerprint("model", a)
    assert changed[0] != first[0] and len(parses) == 2
    assert check.tokenizer_fingerprint("teacher", b) == first  # the other file is as it was


def test_a_directory_without_a_tokenizer_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"model.path=.* has no tokenizer .*save one beside the model"):
        check.tokenizer_fingerprint("model", str(tmp_path))
