"""A damaged shared artefact is one line before it is trained on (kdsweep.data.integrity): a teacher cache with a
changed byte, a truncated file or a missing one, and a tokenization cache with a changed byte. Each job exits 1 with
the line naming the file and the fix, its run.json says ``failed`` with it, and it wrote no training row; doing what
the line says (deleting the artefact) rebuilds it, and the job trains to the intact cache's objective."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import QUIET, kdsweep, read_metrics, read_run

pytestmark = pytest.mark.slow

JOB = ["train=smoke", "teacher.logits=cache", "teacher.cache.method=sample", "train.threads=1", *QUIET]


def job(root: Path, name: str, check: bool = True):
    return kdsweep(*JOB, f"teacher.cache.dir={root / 'teacher'}", f"data.cache_dir={root / 'data'}",
                   f"hydra.run.dir={root / name}", cwd=root, check=check)


@pytest.fixture(scope="module")
def intact(tmp_path_factory, zoo_dirs):
    """A job that builds its own tokenization and teacher caches (not the session's: they are damaged here)."""
    root = tmp_path_factory.mktemp("damaged")
    job(root, "intact")
    return root, read_run(root / "intact")["objective"]


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _refused(root: Path, name: str, file: Path, why: str) -> str:
    proc = job(root, name, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("kdsweep: error:")]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    line = lines[0]
    assert f"{file} {why}" in line and f"delete {file.parent} and the next job that needs it builds it again" in line
    assert "Traceback" not in proc.stderr
    record = read_run(root / name)
    assert record["status"] == "failed" and str(file) in record["error"]
    trained = read_metrics(root / name) if (root / name / "metrics.jsonl").exists() else []
    assert not [r for r in trained if r["kind"] == "train"]  # nothing trained on
    return line


@pytest.mark.parametrize("damage", ["changed", "truncated", "missing"])
def test_a_damaged_teacher_cache_is_one_line_and_deleting_it_as_told_rebuilds_it(intact, damage):
    root, objective = intact
    cache = next((root / "teacher").glob("[0-9a-f]*"))
    saved = root / f"saved-{damage}"
    shutil.copytree(cache, saved)
    ids = cache / "train.ids.0"
    try:
        if damage == "changed":  # the case found from outside: the draws every trial of a sweep reads
            _flip(ids, 1000)
            _refused(root, f"changed-{damage}", ids, "has changed bytes in block 0")
            shutil.rmtree(cache)  # the line's fix, as a user would follow it
            job(root, "rebuilt")
            assert (root / "teacher" / cache.name / "train.ids.0").is_file()
            assert read_run(root / "rebuilt")["objective"] == pytest.approx(objective, abs=1e-6)
        elif damage == "truncated":
            ids.write_bytes(ids.read_bytes()[:-100])
            size = ids.stat().st_size
            _refused(root, damage, ids, f"is {size} bytes, {size + 100} when it was written (truncated)")
        else:
            (cache / "train.entropy.0").unlink()
            _refused(root, damage, cache / "train.entropy.0", "is missing")
    finally:  # intact again for the next case
        shutil.rmtree(cache, ignore_errors=True)
        shutil.copytree(saved, cache)


def test_a_damaged_tokenization_cache_is_one_line(intact):
    root, _ = intact
    rows = next((root / "data").glob("[0-9a-f]*")) / "train.pt"
    saved = rows.read_bytes()
    _flip(rows, len(saved) // 2)
    try:
        _refused(root, "tokens-changed", rows, "has changed bytes")
    finally:
        rows.write_bytes(saved)
