"""No rank waits inside a collective for another rank's I/O: what rank 0 alone waits on takes as long as it takes.

Two 2-rank jobs started together need the same teacher cache, not built yet, with ``dist.timeout_s`` far below the
build's time: one builds it, the other's rank 0 waits on the build's lock and its rank 1 waits for rank 0's word
in a file, not in a collective, so both complete (before, the waiting job died in ``broadcast_object`` after
``dist.timeout_s``). Their teacher is hashed for the first time too, and that takes longer than the timeout (one
file of its directory takes twice the timeout to open, as a slow filesystem's would). The same as a Hydra grid on
the SLURM cluster. And each rank reads its own share
of each model: a rank 0 that takes 10 s a file is waited for outside collectives. Waiting ranks say so in their logs
(``KDSWEEP_WAIT_SAY_S``: every second here, a minute by default).
"""

import os
import re
import subprocess
import sys

import pytest

from conftest import QUIET, kdsweep, read_run
from helpers import with_sitecustomize

pytestmark = pytest.mark.slow

TIMEOUT_S = 3
JOB = ["dist=fsdp2_local", f"dist.timeout_s={TIMEOUT_S}", "train=smoke", "train.max_steps=2",
       "checkpoint.export_merged=false", *QUIET]
# every training row of the cache (not just a seed's): both jobs need the same one, and its pass takes seconds
CACHE = ["teacher.logits=cache", "teacher.cache.rows=all"]
SAY = {"KDSWEEP_WAIT_SAY_S": "1"}


# Rank 0 on a slow parallel filesystem: each safetensors file it opens for reading takes 10 s to come
SLOW_READS = """
import os, time

_open = os.open


def _slow_open(path, *args, **kwargs):
    if os.environ.get("RANK") == "0" and str(path).endswith(".safetensors"):
        time.sleep(10)
    return _open(path, *args, **kwargs)


os.open = _slow_open
"""


def _start(args, cwd, env=None):
    return subprocess.Popen([sys.executable, "-m", "kdsweep", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def _longest_wait(log: str, what: str) -> float:
    """The longest wait a rank said it had so far for ``what``."""
    waits = [float(s) for s in re.findall(rf"waiting (\d+) s so far for rank 0 to {what}", log)]
    waits += [float(s) for s in re.findall(r"another job is building it .*; waited (\d+) s so far", log)]
    return max(waits, default=0.0)


# The teacher's hash on a slow filesystem: its one extra file (slow_to_hash) takes twice the timeout to open, on any
# machine (2 GB of zeros took 2 s to hash here, under the timeout on a quiet machine, over it on a busy one)
SLOW_HASH = f"""
import builtins, time

_open = builtins.open


def _slow_open(file, *args, **kwargs):
    if str(file).endswith("padding.bin"):
        time.sleep({2 * TIMEOUT_S})
    return _open(file, *args, **kwargs)


builtins.open = _slow_open
"""


def slow_to_hash(teacher, zoo_teacher):
    """The embedded teacher's files, and one more that only the hash reads, slow to open (SLOW_HASH)."""
    teacher.mkdir()
    for f in zoo_teacher.iterdir():
        if f.is_file():
            os.link(f, teacher / f.name)
    (teacher / "padding.bin").write_bytes(b"\0" * 4096)
    return teacher


@pytest.fixture(scope="module")
def two_jobs_one_cache(tmp_path_factory, zoo_dirs):
    root = tmp_path_factory.mktemp("two_jobs")
    teacher = slow_to_hash(root / "teacher", zoo_dirs["teacher"])
    cache = root / "teacher_cache"
    env = {**SAY, **with_sitecustomize(root / "slow_hash_site", SLOW_HASH)}
    procs = {name: _start([*JOB, *CACHE, f"teacher.path={teacher}", f"teacher.cache.dir={cache}",
                           f"hydra.run.dir={root / name}"], root, env) for name in ("a", "b")}
    outs = {name: p.communicate(timeout=600) for name, p in procs.items()}
    return root, procs, outs


def assert_one_built_and_one_waited(run_dirs, same_run=True):
    """Of two completed jobs, one built the cache (longer than a collective may wait) and the other read it after
    its rank 0 waited on the build's lock and its rank 1 on rank 0's word, both longer than the timeout."""
    records = {d: read_run(d) for d in run_dirs}
    assert all(r["status"] == "completed" and r["world_size"] == 2 for r in records.values()), records
    built = [d for d, r in records.items() if r["teacher_targets"]["built"]]
    assert len(built) == 1, records
    (waiter,) = set(run_dirs) - set(built)
    assert records[built[0]]["teacher_targets"]["build"]["seconds"] > TIMEOUT_S
    rank0, rank1 = (waiter / "kdsweep.log").read_text(), (waiter / "logs" / "rank1.log").read_text()
    assert _longest_wait(rank1, "take the build lock") >= TIMEOUT_S, rank1[-3000:]
    assert _longest_wait(rank0, "") >= TIMEOUT_S and "another job is building it" in rank0, rank0[-3000:]
    assert records[waiter]["teacher_targets"]["dir"] == records[built[0]]["teacher_targets"]["dir"]
    if same_run:
        assert records[waiter]["objective"] == pytest.approx(records[built[0]]["objective"], abs=1e-6)


def test_two_jobs_needing_one_unbuilt_cache_both_complete_one_built_it_the_other_waited(two_jobs_one_cache):
    root, procs, outs = two_jobs_one_cache
    for name, p in procs.items():
        assert p.returncode == 0, (name, outs[name][1][-3000:])
    assert_one_built_and_one_waited([root / name for name in procs])


def test_the_teachers_first_hash_longer_than_the_timeout_was_waited_for_outside_collectives(two_jobs_one_cache):
    root, procs, _ = two_jobs_one_cache  # both completed (above); the one that hashed first waited that long
    waits = [_longest_wait((root / name / "logs" / "rank1.log").read_text(), "hash the teacher's files")
             for name in procs]
    assert max(waits) >= TIMEOUT_S, waits


@pytest.mark.usefixtures("slurm_cluster")
def test_a_slurm_grid_of_two_jobs_needing_one_unbuilt_cache_completes(tmp_path, zoo_dirs):
    sweep = tmp_path / "sweep"
    proc = kdsweep("-m", "train.seed=0,1", "hydra/launcher=submitit_slurm", "cluster=local_cpu", "train.threads=1",
                   *JOB[1:], *CACHE, f"teacher.cache.dir={tmp_path / 'cache'}", f"hydra.sweep.dir={sweep}",
                   cwd=tmp_path, check=False, env_extra=SAY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_one_built_and_one_waited([sweep / "0", sweep / "1"], same_run=False)  # two seeds, one cache of all rows


def test_rank0_reading_its_share_slowly_is_waited_for_outside_collectives(tmp_path):
    """Every rank reads its own share of each model; rank 0 takes 10 s a file, over three times ``dist.timeout_s``:
    rank 1, done long before, waits for it in a file, not in a collective, and the job completes."""
    proc = _start([*JOB, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path,
                  {**SAY, **with_sitecustomize(tmp_path / "slow_site", SLOW_READS)})
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    record = read_run(tmp_path / "run")
    assert record["status"] == "completed" and record["world_size"] == 2, record
    rank1 = (tmp_path / "run" / "logs" / "rank1.log").read_text()
    for model in ("teacher", "student"):
        assert _longest_wait(rank1, f"see every rank load its share of the {model}") >= TIMEOUT_S, rank1[-3000:]
