import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# The embedded zoo is built from scratch once per cache, as a user's first run builds it. The second teacher
# (tiny-teacher-other: its own tokenizer, then the tiny teacher's pre-training) is needed only by the integration
# tests of a teacher with another tokenizer, well into the session, and the unit tests (first in testpaths) are
# mostly one-threaded. So a session that runs integration tests starts its build at once, in a background process
# of one thread at the lowest priority, on the core the unit tests leave idle; a test that needs it before it is
# done waits on the build's lock (kdsweep.data.cache.built_once), as a user's second job would. Nothing is built
# twice, and the tiny teacher and student are still built where the first test needs them (tests/integration).
BACKGROUND_ZOO = ("tiny-teacher-other",)
_zoo_build: list[subprocess.Popen] = []


def pytest_collection_finish(session):
    if session.config.option.collectonly or not any("integration" in item.nodeid for item in session.items):
        return
    code = ("import torch; torch.set_num_threads(1); from kdsweep.models import zoo; "
            f"[zoo.model_dir(name) for name in {BACKGROUND_ZOO!r}]")
    _zoo_build.append(subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"},
                                       preexec_fn=lambda: os.nice(19), stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL))


def pytest_sessionfinish(session, exitstatus):
    for proc in _zoo_build:  # a session cut short: its half-built model is a temp directory nothing reads
        if proc.poll() is None:
            proc.terminate()
        proc.wait()
