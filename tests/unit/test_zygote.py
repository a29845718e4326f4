"""The tests' zygote (tests/zygote.py) runs a module as a fresh ``python -m`` runs it: the same stdout, stderr and
status, in the job's directory, with its argv, environment and ``sys.path[0]``; what the zygote's imports printed is
printed again; non-daemon threads are joined and ``atexit`` runs before it ends; a timeout kills it."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import zygote

# a module the zygote imports before it serves, and that prints and warns as it is imported
LOUD = """import sys, warnings
print("loud: imported")
print("loud: to stderr", file=sys.stderr)
warnings.warn("loud: a warning at import", FutureWarning)
"""
PROBE = """import atexit, os, sys, threading, time
import loud
print("argv", sys.argv[1:], "path0 is cwd", sys.path[0] == os.getcwd(), "probe", os.environ.get("ZYGOTE_PROBE"))
print("probe: to stderr", file=sys.stderr)
threading.Thread(target=lambda: (time.sleep(0.3), print("thread: done", flush=True))).start()
atexit.register(lambda: print("atexit: ran", flush=True))
print("progress\\r" * 2, end="", file=sys.stderr)
if sys.argv[1:] == ["sleep"]:
    open("pid", "w").write(str(os.getpid()))
    time.sleep(60)
if sys.argv[1:] == ["raise"]:
    raise ValueError("probe: raised")
raise SystemExit(int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    lib = tmp_path_factory.mktemp("lib")
    (lib / "loud.py").write_text(LOUD)
    env = {**os.environ, "PYTHONPATH": str(lib), "PYTHONUNBUFFERED": "1", "ZYGOTE_PROBE": "seen"}
    z = zygote.Zygote(env, preload=["loud"])
    yield z, env
    z.close()


@pytest.mark.parametrize("arg", ["0", "3", "a message to stderr", "raise"])
def test_a_forked_module_prints_and_ends_as_a_fresh_python(server, tmp_path, arg):
    z, env = server
    (tmp_path / "probe.py").write_text(PROBE)
    fresh = subprocess.run([sys.executable, "-m", "probe", arg], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=60)
    forked = z.run(["-m", "probe", arg], tmp_path, env, timeout=60)
    assert "loud: imported" in forked.stdout and "FutureWarning" in forked.stderr  # the zygote's, printed again
    assert "thread: done" in forked.stdout and "atexit: ran" in forked.stdout
    assert f"argv ['{arg}'] path0 is cwd True probe seen" in forked.stdout
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


def test_a_job_past_its_timeout_is_killed(server, tmp_path):
    z, env = server
    (tmp_path / "probe.py").write_text(PROBE)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        z.run(["-m", "probe", "sleep"], tmp_path, env, timeout=2)
    pid = int((tmp_path / "pid").read_text())
    while time.monotonic() - started < 30 and Path(f"/proc/{pid}").exists():  # killed, then reaped by its supervisor
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists()


def test_an_environment_asked_for_once_runs_fresh_and_twice_gets_a_zygote(monkeypatch, tmp_path):
    monkeypatch.setattr(zygote, "_asked", {})
    monkeypatch.setattr(zygote, "_zygotes", {})
    monkeypatch.setattr(zygote, "preload", list)  # nothing to import
    (tmp_path / "probe.py").write_text("import os; print('ran', os.environ.get('KDSWEEP_TEST_CRASH_AT'))")
    env = {**os.environ, "PYTEST_CURRENT_TEST": "one"}
    try:
        assert zygote.run(["-m", "probe"], tmp_path, env, 60) is None
        second = zygote.run(["-m", "probe"], tmp_path, {**env, "PYTEST_CURRENT_TEST": "two"}, 60)  # the same one
        assert second.stdout == "ran None\n" and len(zygote._zygotes) == 1
        crash = {**env, "KDSWEEP_TEST_CRASH_AT": "after_launch:2"}  # volatile too: the same one, with it set
        assert zygote.run(["-m", "probe"], tmp_path, crash, 60).stdout == "ran after_launch:2\n"
        assert len(zygote._zygotes) == 1
        assert zygote.run(["-m", "probe"], tmp_path, {**env, "ZYGOTE_PROBE": "other"}, 60) is None
    finally:
        zygote.close_all()
