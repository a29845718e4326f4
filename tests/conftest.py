import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# The suite runs in two pytest-xdist workers (addopts: -n 2), one per core of this 2-core machine: most of its time
# is jobs of one busy thread (a process's imports, a tiny model's steps, a controller's polls). It is CPU-bound: with
# three workers the cores were busy 94% of CI's run and CI took longer (36:08 against 34:51; the SLURM jobs' CPU is
# slurmd's, not the test processes'), so only less work makes it faster. Every job the tests start gets one
# intra-op thread, as each of two concurrent trials gets one from the controller: torch's default of a thread per
# core would make two jobs' threads wait on each other at every step. A job that sets train.threads, or an
# environment that sets OMP_NUM_THREADS, keeps its own.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The embedded zoo is built from scratch once per cache, as a user's first run builds it. A session that runs
# integration tests starts building it at once, in one background process (one thread), while the workers
# run the unit tests (first in testpaths); a test that needs a model before it is done waits on the build's
# lock (kdsweep.data.cache.built_once), as a user's second job would. Nothing is built twice.
BACKGROUND_ZOO = ("tiny-teacher", "tiny-student", "tiny-teacher-other")
_zoo_build: list[subprocess.Popen] = []


# CI keeps the zoo it pre-trained between runs on one machine (tests/zoo_store.py): four CPU-minutes of every run.
ZOO_STORE = os.environ.get("KDSWEEP_ZOO_STORE")
_zoo_restored: list[str] = []


def _controller(config) -> bool:
    return not hasattr(config, "workerinput")  # xdist's controller (or a run without workers), not a worker


def pytest_configure(config):
    if ZOO_STORE and _controller(config):  # before the workers start
        import zoo_store
        from kdsweep.models import zoo

        try:
            _zoo_restored.extend(zoo_store.restore(Path(ZOO_STORE), zoo.cache_root()))
        except OSError as e:  # then the zoo is built, as without a store
            print(f"zoo store {ZOO_STORE}: not restored ({e})", file=sys.stderr)


def pytest_report_header(config):
    if ZOO_STORE:
        return f"zoo store {ZOO_STORE}: {', '.join(_zoo_restored) or 'nothing for this key'} restored"


def pytest_collection_finish(session):
    if session.config.option.collectonly or not any("integration" in item.nodeid for item in session.items):
        return
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":  # every worker collects the session: one builds
        return
    code = f"from kdsweep.models import zoo; [zoo.model_dir(name) for name in {BACKGROUND_ZOO!r}]"
    _zoo_build.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL))


def pytest_sessionfinish(session, exitstatus):
    import zygote

    zygote.close_all()
    for proc in _zoo_build:  # a session cut short: its half-built model is a temp directory nothing reads
        if proc.poll() is None:
            proc.terminate()
        proc.wait()
    if ZOO_STORE and _controller(session.config):
        import zoo_store
        from kdsweep.models import zoo

        try:
            zoo_store.save(Path(ZOO_STORE), zoo.cache_root())
        except OSError as e:  # the store only saves time: a run that cannot fill it still passed or failed as it did
            print(f"\nzoo store {ZOO_STORE}: not saved ({e})", file=sys.stderr)


# Which worker runs what. Each test file goes to one worker whole (its module fixtures are built once), and so
# do the files that share one built artefact through helpers.once (a second worker would build it again).
# Files are handed out in collection order: the unit and config tests first, then the integration files that
# need no embedded model (while the zoo builds), then the others, the longest first, so that the session does
# not end waiting on one long file.
SHARED = {  # file -> the file whose artefact it reads
    "tests/integration/test_dashboard.py": "tests/integration/test_sweep.py",  # faults_sweep
    "tests/integration/test_storages.py": "tests/integration/test_teacher_cache.py",  # local_cache_sweep
    "tests/integration/test_slurm_jobs.py": "tests/integration/test_cli_run.py",  # smoke_run
}
LONGEST_FIRST = [f"tests/integration/test_{name}.py" for name in (
    "architectures", "slurm_cluster", "presets",  # no embedded model: run while the zoo builds
    # then by CI's per-file times, the SHARED groups summed
    "docs", "launch", "teacher_cache", "multirank", "sweep", "verdict", "workers", "cross_tokenizer", "pack_job",
    "hf_models", "rollout", "cli_run", "budget_mixed", "slurm_workers", "eval", "teacher_placement", "bad_input",
    "data_jobs", "slurm_confirm", "rank_failures", "analysis", "slurm_sweep", "rank0_waits", "gpu_check", "prepare",
    "resume", "hints", "slurm_pack", "damaged_artefacts", "tracking", "pack_sweep", "wheel", "vocab")]


def _group(nodeid: str) -> str:
    """The file a test belongs to, or the one whose artefact its file reads (SHARED)."""
    name = nodeid.split("::", 1)[0]
    return SHARED.get(name, name)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def order(item):
        name = _group(item.nodeid)
        return (name.startswith("tests/integration/"), rank.get(name, len(rank)))

    items.sort(key=order)  # stable: within a group, collection order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadFileScheduling

    class ByFile(LoadFileScheduling):
        """xdist's loadfile, with the SHARED files on their artefact's worker and the order above kept."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False  # xdist would put the files with the most tests first

        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return ByFile(config, log)
