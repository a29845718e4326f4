"""Sweeps on the storages a cluster uses: a real PostgreSQL server (password required) and a journal file.

A password given in the storage URL must never reach a file, a log or a printed line.
"""

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest

from conftest import free_port, tiny_sweep
from test_teacher_cache import local_cache_sweep

pytestmark = pytest.mark.slow


def fresh_database(server_url: str, name: str) -> str:
    """Drop and create database ``name`` on the server (the role may create databases); its URL."""
    import psycopg2

    conn = psycopg2.connect(server_url.replace("+psycopg2", ""))
    conn.autocommit = True  # CREATE DATABASE cannot run in a transaction
    with conn.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        cur.execute(f"CREATE DATABASE {name}")
    conn.close()
    return server_url.rsplit("/", 1)[0] + f"/{name}"


def password_of(url: str) -> str:
    return re.match(r"[^:]+://[^:/@]+:([^@/]+)@", url).group(1)


def files_holding(root: Path, secret: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def without_storage_env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "KDSWEEP_STORAGE_URL"}


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kdsweep", *args], capture_output=True, text=True, timeout=120,
                          env=env or without_storage_env())


def check_completed(study: optuna.Study, sweep_dir: Path, n: int = 2,
                    status: subprocess.CompletedProcess | None = None) -> subprocess.CompletedProcess:
    """All ``n`` trials COMPLETE in the storage, with the values the controller saw, and so in `kdsweep status`
    (``status``: that command's run, if it was made already); returns that run."""
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * n
    manifest = json.loads((sweep_dir / "sweep.json").read_text())["trials"]
    for t in trials:
        assert t.value == pytest.approx(manifest[str(t.number)]["values"][0]) and 0 < t.value < 20
        assert set(t.params) == {"kd_ratio"}
    assert not (sweep_dir / "optuna.db").exists(), "the study must live in the given storage, not SQLite"
    status = status or cli("status", str(sweep_dir))
    assert status.returncode == 0 and status.stdout.count("COMPLETE") == n and "<- best" in status.stdout, status.stderr
    return status


def test_postgresql_storage_with_a_password(tmp_path, zoo_dirs, postgres_server, monkeypatch):
    url = fresh_database(postgres_server, "kdsweep_test_storages")
    secret = password_of(url)
    key = "fake-wandb-key-5f2c9a7e31d84b6c0a9e7d3b1c5f8a2e4d6b0c19"
    monkeypatch.setenv("WANDB_API_KEY", key)  # the trials log to W&B (offline here) with a key in their env
    sweep_dir, proc = tiny_sweep(tmp_path, "pg_study", f"hydra.sweeper.storage={url}", "logger.wandb.enabled=true")
    assert files_holding(tmp_path, key) == [] and key not in proc.stdout + proc.stderr
    assert all(list((sweep_dir / str(n) / "wandb").glob("offline-run-*")) for n in (0, 1))  # W&B really ran

    status = check_completed(optuna.load_study(study_name="pg_study", storage=url), sweep_dir)
    assert "kdsweep:***@127.0.0.1" in status.stdout
    # Nowhere on disk (sweep.json, run.json, logs, Hydra's saved configs, checkpoints) and nowhere printed.
    assert files_holding(tmp_path, secret) == []
    assert secret not in proc.stdout + proc.stderr

    # Resuming needs the password too: the saved command holds kdsweep:***@, the full URL comes from the env.
    no_pw = cli("resume", str(sweep_dir))
    assert no_pw.returncode == 2 and "needs its password: set KDSWEEP_STORAGE_URL" in no_pw.stderr.splitlines()[-1]
    resumed = cli("resume", str(sweep_dir), env={**os.environ, "KDSWEEP_STORAGE_URL": url})
    assert resumed.returncode == 0 and resumed.stdout.count("COMPLETE") == 2, resumed.stderr
    assert files_holding(tmp_path, secret) == []

    # The dashboard reads the same study; without the password it says how to give it.
    no_pw = cli("dashboard", str(sweep_dir), "--port", str(free_port()))
    assert no_pw.returncode == 2 and no_pw.stderr.count("\n") == 1 and "set KDSWEEP_STORAGE_URL" in no_pw.stderr
    other = cli("dashboard", str(sweep_dir), env={**os.environ, "KDSWEEP_STORAGE_URL": url + "_other"})
    assert other.returncode == 2 and other.stderr.count("\n") == 1 and "is not the storage of" in other.stderr
    assert secret not in other.stderr
    port = free_port()
    dash = subprocess.Popen([sys.executable, "-m", "kdsweep", "dashboard", str(sweep_dir), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "KDSWEEP_STORAGE_URL": url})
    try:
        deadline = time.time() + 60
        while True:
            assert dash.poll() is None and time.time() < deadline, "kdsweep dashboard did not answer"
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5).read().decode()
                break
            except OSError:
                time.sleep(0.3)
        assert '"study_name": "pg_study"' in body
    finally:
        dash.terminate()
        dash.wait(timeout=30)


def test_journal_file_storage(tmp_path_factory, zoo_dirs):
    """On test_teacher_cache.py's sweep of 3 local trials (built once for both), whose study is in a journal file."""
    from optuna.storages.journal import JournalFileBackend

    sweep = local_cache_sweep(tmp_path_factory)
    storage = optuna.storages.JournalStorage(JournalFileBackend(str(sweep.journal)))
    check_completed(optuna.load_study(study_name="cache_local", storage=storage), sweep.sweep_dir, n=3,
                    status=sweep.status)


@pytest.mark.parametrize("case", ["closed_port", "wrong_password"])
def test_an_unusable_database_is_one_line_without_the_password(case, tmp_path, request):
    if case == "closed_port":
        url, secret = f"postgresql+psycopg2://kdsweep:s3cret-pw-7@127.0.0.1:{free_port()}/kdsweep", "s3cret-pw-7"
    else:  # the server is up, so this also shows that it really asks for the password
        server = request.getfixturevalue("postgres_server")
        url, secret = re.sub(r":[^:@/]+@", ":wrong-pw-7@", server), "wrong-pw-7"
    sweep_dir, proc = tiny_sweep(tmp_path, "unreachable", f"hydra.sweeper.storage={url}", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("kdsweep: error:") and "cannot be reached" in lines[0]
    assert "kdsweep:***@127.0.0.1" in lines[0]
    assert ("Connection refused" if case == "closed_port" else "password authentication failed") in lines[0]
    assert secret not in proc.stdout + proc.stderr and files_holding(tmp_path, secret) == []
    assert not any(p.is_dir() and p.name.isdigit() for p in sweep_dir.glob("*")), "no trial may start"


# Steps enough that both trials still train well after the server stops at their 5th (down.sh takes about a second,
# a step a fifth of one here): each reports at least once while it is away.
RESTART_STEPS = 40


def test_a_postgresql_restart_mid_sweep_costs_nothing(tmp_path, zoo_dirs, postgres_server):
    """The real server stopped (pg_ctl -m fast: every session ended) while two trials run and report, and started
    again 10 s later: the sweep completes without a resume, every trial COMPLETE on its merits and none FAIL; the
    controller and the trials waited for it (kdsweep.sweep.patient)."""
    from concurrent.futures import ThreadPoolExecutor

    from test_workers import train_steps, wait_for

    url = fresh_database(postgres_server, "kdsweep_test_restart")
    postgres = Path(__file__).resolve().parents[2] / "launchers" / "postgres"
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(tiny_sweep, tmp_path, "restart", f"hydra.sweeper.storage={url}",
                          f"train.max_steps={RESTART_STEPS}", "train.eval_every=5", check=False)
        sweep_dir = tmp_path / "sweep"
        wait_for(lambda: all(len(train_steps(sweep_dir / str(n))) >= 5 for n in (0, 1)), "both trials' 5th step")
        subprocess.run(["bash", str(postgres / "down.sh")], check=True, capture_output=True, timeout=120)
        stopped = time.time()
        time.sleep(10)
        subprocess.run(["bash", str(postgres / "up.sh")], check=True, capture_output=True, timeout=300)
        sweep_dir, proc = run.result(timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = optuna.load_study(study_name="restart", storage=url)
    assert [t.state.name for t in study.get_trials()] == ["COMPLETE"] * 2
    manifest = json.loads((sweep_dir / "sweep.json").read_text())["trials"]
    assert all(t["state"] == "COMPLETE" and t["attempts"] == 1 for t in manifest.values())
    # the trials were reporting when the server went: they waited, and went on after it came back
    waited = [line for n in (0, 1) for line in (sweep_dir / str(n) / "kdsweep.log").read_text().splitlines()
              if "the study's storage is away" in line]
    assert waited, "no trial reported while the server was down"
    assert all(max(train_steps(sweep_dir / str(n))) == RESTART_STEPS for n in (0, 1))
    assert time.time() - stopped < 300


def test_a_storage_away_longer_than_its_grace_ends_the_controller_in_one_line_and_resume_goes_on(
        tmp_path, zoo_dirs, postgres_server):
    from concurrent.futures import ThreadPoolExecutor

    from test_workers import train_steps, wait_for

    url = fresh_database(postgres_server, "kdsweep_test_away")
    postgres = Path(__file__).resolve().parents[2] / "launchers" / "postgres"
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(tiny_sweep, tmp_path, "away", f"hydra.sweeper.storage={url}", "train.max_steps=120",
                          "train.eval_every=5", "hydra.sweeper.storage_grace_s=2", check=False)
        sweep_dir = tmp_path / "sweep"
        wait_for(lambda: len(train_steps(sweep_dir / "0")) >= 5, "trial 0's 5th step")
        subprocess.run(["bash", str(postgres / "down.sh")], check=True, capture_output=True, timeout=120)
        try:
            sweep_dir, proc = run.result(timeout=300)
        finally:
            subprocess.run(["bash", str(postgres / "up.sh")], check=True, capture_output=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1].startswith("kdsweep: error: the study's storage was away longer than "
                                                         "hydra.sweeper.storage_grace_s"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and password_of(url) not in proc.stderr
    hint = lines[-1].split("`")[1]  # what the line says to run, run
    assert hint == f"kdsweep resume {sweep_dir}"
    resumed = cli(*hint.split()[1:], env={**os.environ, "KDSWEEP_STORAGE_URL": url})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    study = optuna.load_study(study_name="away", storage=url)
    assert len(study.get_trials()) == 2 and all(t.state.name in ("COMPLETE", "FAIL") for t in study.get_trials())
