"""The requeue a job asks for from inside itself survives the SIGTERM that requeue sends to the job's processes."""

import os
import subprocess
import textwrap

import pytest

from kdsweep.distributed import signals

FAKE_SCONTROL = textwrap.dedent("""\
    #!/bin/bash
    # as slurmd does when the requeue lands before scontrol exits: SIGTERM to every process of the job
    echo "$@" > "$(dirname "$0")/asked"
    kill -TERM $$
    exit 0
""")


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    path = tmp_path / "scontrol"
    path.write_text(FAKE_SCONTROL)
    path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    return tmp_path


def test_the_fake_scontrol_dies_of_sigterm_when_run_plainly(scontrol):
    with pytest.raises(subprocess.CalledProcessError, match="SIGTERM"):
        subprocess.check_call(["scontrol", "requeue", "7"], timeout=60)  # submitit's own call


def test_requeue_survives_its_own_sigterm_and_submitits_goes_through_it(scontrol, monkeypatch):
    assert signals.requeue("7") == 0
    assert (scontrol / "asked").read_text().split() == ["requeue", "7"]
    from submitit.slurm.slurm import SlurmJobEnvironment

    original = SlurmJobEnvironment._requeue
    try:
        signals.harden_submitit_requeue()
        signals.harden_submitit_requeue()  # idempotent
        env = SlurmJobEnvironment.__new__(SlurmJobEnvironment)
        monkeypatch.setenv("SLURM_JOB_ID", "8")
        env._requeue(3)  # submitit's call after checkpoint(): no error for a job that was requeued
        assert (scontrol / "asked").read_text().split() == ["requeue", "8"]
    finally:
        SlurmJobEnvironment._requeue = original
