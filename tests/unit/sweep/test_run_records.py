"""Every reader of run.json goes through one function (kdsweep.metrics.records.read_run): missing is empty, a
settled record is parsed once until it changes, a damaged one is one line."""

import json
import os
import time

import pytest

from kdsweep.config.schema import ConfigError
from kdsweep.metrics import records
from kdsweep.metrics.records import read_run


def test_a_settled_record_is_parsed_once_until_it_is_rewritten(tmp_path, monkeypatch):
    assert read_run(tmp_path) == {}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"status": "running"}))
    old = time.time() - 10
    os.utime(path, (old, old))  # settled: written longer ago than SETTLED_S
    parsed = []
    loads = json.loads
    monkeypatch.setattr(records.json, "loads", lambda text: parsed.append(1) or loads(text))
    assert read_run(tmp_path) == {"status": "running"} and read_run(tmp_path) == {"status": "running"}
    assert len(parsed) == 1  # the second read was the kept one
    records.write_json_atomic(path, {"status": "completed"})  # a new inode, mtime and size
    assert read_run(str(tmp_path))["status"] == "completed" and len(parsed) == 2
    assert read_run(tmp_path)["status"] == "completed" and len(parsed) == 3  # young: parsed at every read


def test_a_damaged_record_is_one_line_naming_it(tmp_path):
    (tmp_path / "run.json").write_text('{"status": "comp')
    with pytest.raises(ConfigError) as e:
        read_run(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'run.json'} is not valid JSON") and "\n" not in str(e.value)
