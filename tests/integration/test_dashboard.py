"""`kdsweep dashboard` serves a real sweep's study, and headless Chromium renders it (DOM checked, screenshot saved).

The sweep is test_sweep.py's sweep of a failing trial and two complete ones, built once for both modules."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, free_port
from test_sweep import faults_sweep, study

pytestmark = pytest.mark.slow

ARTIFACTS = Path(os.environ.get("KDSWEEP_ARTIFACTS") or REPO / "artifacts")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                  "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--virtual-time-budget=15000"]  # the React page needs it, or it dumps an empty skeleton


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail("chromium is not installed: run .ci/run, or apt-get install -y chromium")
    profile = tempfile.mkdtemp(prefix="chromium-profile-", dir=tmp_path)  # a new empty profile per run
    proc = subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def visible_text(html: str) -> list[str]:
    """The rendered page's text nodes, one per line (scripts and styles left out)."""
    html = re.sub(r"<(script|style)\b[^>]*>.*?</\1>", "", html, flags=re.S)
    return [line.strip() for line in re.sub(r"<[^>]+>", "\n", html).splitlines() if line.strip()]


def test_dashboard_serves_the_study_and_chromium_renders_it(tmp_path, tmp_path_factory, zoo_dirs):
    sweep_dir, _ = faults_sweep(tmp_path_factory)
    trials_of_study = study(sweep_dir, "faults").trials
    port = free_port()
    log = tmp_path / "dashboard.log"
    with open(log, "w") as out:
        dash = subprocess.Popen([sys.executable, "-m", "kdsweep", "dashboard", str(sweep_dir), "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.time() + 60
        while True:  # the URL is printed, then the server answers
            assert dash.poll() is None and time.time() < deadline, f"no dashboard:\n{log.read_text()}"
            match = re.search(rf"^http://127\.0\.0\.1:{port}/dashboard/ .*studies/(\d+)", log.read_text(), re.M)
            try:
                if match and urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5).status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.3)
        study_url = f"http://127.0.0.1:{port}/dashboard/studies/{match.group(1)}"

        # A second dashboard on the same port is one line, not a traceback.
        busy = subprocess.run([sys.executable, "-m", "kdsweep", "dashboard", str(sweep_dir), "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
        assert busy.returncode == 2 and busy.stderr.count("\n") == 1, busy.stderr
        assert busy.stderr.startswith("kdsweep: error: cannot serve on 127.0.0.1:") and not busy.stdout

        # The study's trial list, as the browser renders it: the study by name, "3 Trials", each one in the state
        # the study holds (Fail, Complete, Complete on a machine without CUDA).
        text = visible_text(chromium(tmp_path, "--dump-dom", f"{study_url}/trials").stdout)
        assert f"faults (id={match.group(1)})" in text, text
        assert "3 Trials" in text, text
        trials = [i for i, line in enumerate(text) if re.fullmatch(r"Trial \d+", line)]
        assert [text[i] for i in trials] == ["Trial 0", "Trial 1", "Trial 2"], text
        assert [text[i + 1] for i in trials] == [t.state.name.capitalize() for t in trials_of_study], text

        # The study's page (history, importance, timeline) as a CI artifact.
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        shot.unlink(missing_ok=True)
        chromium(tmp_path, f"--screenshot={shot}", "--window-size=1400,900", study_url)
        png = shot.read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
        assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (1400, 900)
    finally:
        dash.terminate()
        dash.wait(timeout=30)


def test_dashboard_of_a_directory_that_is_not_a_sweep_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kdsweep", "dashboard", str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"kdsweep: error: {tmp_path} is not a kdsweep sweep directory")
