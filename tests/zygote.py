"""The tests' ``python -m kdsweep`` jobs, forked from a Python that has already imported what every job imports.

Most of a test job's CPU is its imports: torch, transformers (which reads every model's source to index itself),
peft, hydra, kdsweep; about 4.5 CPU-seconds of a 2-step job's 6.8, and the suite starts a few hundred such jobs on
CI's two cores. A zygote is a fresh Python, started in the environment the jobs get, that imports them once and
then forks each job (the way a local job's ranks are forked from their preloaded forkserver: never from a process
that has run OpenMP kernels). What a job does from then on is what ``python -m kdsweep ARGS`` does in a fresh
process, and :func:`run` checks what could tell the two apart:

- **the environment**: a zygote serves only jobs whose environment is the one it imported in (``VOLATILE``
  aside: the test's name and its injected failures, which nothing reads at import); the first job in another
  environment starts a fresh process, and a second one that environment's own zygote (a test worker keeps three);
- **what the imports print**: whatever the zygote's imports wrote to stdout and stderr (a library's warning) is
  written again at the start of each job's own stdout and stderr, as a fresh process would print it;
- **the process**: the job has its own pid, directory, ``sys.argv``, ``sys.path[0]`` (the directory, as for
  ``-m``), file descriptors 0-2 (stdin ``/dev/null``; stdout and stderr pipes read to their end, as
  ``subprocess.run`` reads them) and exit status; it runs in an empty ``__main__`` as ``-m`` does (a traceback
  reads the same); it ends as an interpreter ends (non-daemon threads joined, ``atexit`` run, stdio flushed) but
  for the teardown of every module, and a timeout kills it as ``subprocess.run`` kills its child.

A test about how a process starts (its imports, its command line in ``/proc``) passes ``fresh=True`` to
``conftest.kdsweep``. ``KDSWEEP_TEST_ZYGOTE=0`` turns zygotes off for a whole session.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Set per test or per job, and read by nothing at import: pytest's own, and the failures tests inject into a
# controller or a rank (sweep.controller.CRASH_AT, distributed.failure.RAISE_AT, read when they would fire).
VOLATILE = {"PYTEST_CURRENT_TEST", "KDSWEEP_TEST_CRASH_AT", "KDSWEEP_TEST_RAISE_AT"}
ENABLED = os.environ.get("KDSWEEP_TEST_ZYGOTE", "1") != "0"


def preload() -> list[str]:
    """What a job imports before it does anything of its own (``python -X importtime -m kdsweep``): what its ranks
    import (their forkserver's preload), and the command line's, the LoRA preflight's and the zoo's model. Read
    here, not at this module's import: the server imports this module before it captures what imports print."""
    from kdsweep.startup import RANK_IMPORTS

    return ["kdsweep.cli", *RANK_IMPORTS, "kdsweep.models.targets", "transformers.models.llama.modeling_llama",
            "hydra"]


def _key(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k not in VOLATILE))


class Zygote:
    """One preloaded server, for one environment."""

    def __init__(self, env: dict[str, str], preload: list[str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="kdsweep-zygote-")
        self.path = os.path.join(self.dir, "sock")
        self.log = open(os.path.join(self.dir, "server.log"), "w+b")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([sys.executable, "-c", SERVE, __file__, self.path, *preload], env=env,
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, cwd=self.dir)

    def _connect(self, timeout: float = 300) -> socket.socket:
        deadline = time.monotonic() + timeout
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(self.path)
                return s
            except OSError:
                s.close()
                if self.proc.poll() is not None:
                    self.log.seek(0)
                    raise RuntimeError(f"the zygote ended ({self.proc.returncode}): {self.log.read().decode()}")
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        """``subprocess.run([python, *argv], cwd=, env=, capture_output=True, text=True, timeout=)``, forked."""
        conn = self._connect()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            with open(os.devnull, "rb") as null:
                socket.send_fds(conn, [json.dumps({"argv": argv, "cwd": str(cwd), "env": env}).encode() + b"\n"],
                                [null.fileno(), out_w, err_w])
        finally:
            os.close(out_w)
            os.close(err_w)
        pending = [b""]

        def number(deadline: float | None) -> int:  # the supervisor's next line: the job's pid, then its status
            while b"\n" not in pending[0]:
                conn.settimeout(None if deadline is None else max(0.001, deadline - time.monotonic()))
                data = conn.recv(64)
                if not data:
                    raise RuntimeError("the zygote's supervisor of a job ended without its status")
                pending[0] += data
            line, pending[0] = pending[0].split(b"\n", 1)
            return int(line)

        pid = number(None)
        chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}

        def drain(fd: int) -> None:
            with os.fdopen(fd, "rb") as f:
                while data := f.read1(1 << 16):
                    chunks[fd].append(data)

        threads = [threading.Thread(target=drain, args=(fd,), daemon=True) for fd in (out_r, err_r)]
        for t in threads:
            t.start()
        try:
            status = number(time.monotonic() + timeout)
        except TimeoutError:
            _kill(pid)
            for t in threads:
                t.join()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, b"".join(chunks[out_r]),
                                            b"".join(chunks[err_r])) from None
        finally:
            conn.close()
        for t in threads:
            t.join()
        # as text=True reads them: universal newlines (a progress bar's \r is a \n)
        text = [b"".join(chunks[fd]).decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")
                for fd in (out_r, err_r)]
        return subprocess.CompletedProcess([sys.executable, *argv], status, text[0], text[1])

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_zygotes: dict[tuple, Zygote] = {}
_asked: dict[tuple, int] = {}
_lock = threading.Lock()


def run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess | None:
    """The job forked from the zygote of ``env``, or None where it should run fresh: zygotes off, or the first job
    in this environment (a zygote costs a job's imports: only an environment asked for twice gets one)."""
    if not ENABLED:
        return None
    key = _key(env)
    with _lock:  # jobs may be started from several threads of a test
        _asked[key] = _asked.get(key, 0) + 1
        if key not in _zygotes:
            if _asked[key] < 2:
                return None
            while len(_zygotes) >= 3:  # the oldest environment's goes
                _zygotes.pop(next(iter(_zygotes))).close()
            _zygotes[key] = Zygote(dict(key), preload())
        zygote = _zygotes[key]
    return zygote.run(argv, cwd, env, timeout)


def close_all() -> None:
    while _zygotes:
        _zygotes.popitem()[1].close()


# --- the server ------------------------------------------------------------------------------------------------

# The server's own __main__ is ``-c``'s, as empty as a fresh ``python -m``'s is before the module runs in it.
SERVE = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('kdsweep_zygote', sys.argv[1]); "
         "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
         "module._serve(sys.argv[2], sys.argv[3:])")


def _serve(path: str, preload: list[str]) -> None:
    said = []
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            from kdsweep.startup import import_frozen  # inside the capture, as everything the zygote imports

            import_frozen(preload)  # as a job's process imports them; its jobs inherit the freeze
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
        for f in (out, err):
            f.seek(0)
            said.append(f.read())
    parent = os.getppid()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the supervisors are reaped by the kernel
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    server.listen(16)
    os.rename(path + ".tmp", path)  # a client connects only once the imports are done
    server.settimeout(1.0)
    while os.getppid() == parent:  # the test session's worker went: so does its zygote
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        while msg and not msg.endswith(b"\n"):
            msg += conn.recv(1 << 20) or b"\n"  # a client gone mid-message: json.loads fails in its job, not here
        if os.fork() == 0:  # the supervisor: forks the job, tells the client its pid, then its exit status
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            job = os.fork()
            if job == 0:
                conn.close()
                _job(json.loads(msg), fds, said)  # never returns
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{job}\n".encode())
            _, status = os.waitpid(job, 0)
            code = os.waitstatus_to_exitcode(status)
            try:
                conn.sendall(f"{code}\n".encode())
            finally:
                os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


def _job(request: dict, fds: list[int], said: list[bytes]) -> None:
    """Become ``python -m MODULE ARGS`` (``runpy._run_module_as_main``, what ``-m`` calls) in the request's
    directory and environment, and end with its status."""
    import runpy

    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # -m's first entry: the directory (-c's, the server's, is "")
    for fd, text in ((1, said[0]), (2, said[1])):
        if text:
            os.write(fd, text)
    argv = request["argv"]
    assert argv[0] == "-m", argv
    sys.argv = ["-m", *argv[2:]]  # as -m leaves it until the module is found
    main = sys.modules["__main__"].__dict__
    builtins = main["__builtins__"]
    main.clear()
    main["__builtins__"] = builtins
    try:
        runpy._run_module_as_main(argv[1], alter_argv=True)  # noqa: SLF001
        code = 0
    except SystemExit as e:
        code = e.code
    except BaseException:
        kind, error, trace = sys.exc_info()
        sys.excepthook(kind, error.with_traceback(trace.tb_next), trace.tb_next)  # from runpy's frames down, as -m
        code = 1
    _end(code)


def _end(code: object) -> None:
    """End as an interpreter ends (Py_FinalizeEx: non-daemon threads joined, ``atexit`` run, stdio flushed), less
    its teardown of every module: 1.2 s of CPU after torch and transformers in a fresh process, more in a fork (its
    pages are copied as the teardown touches them), and what multiprocessing's children skip too."""
    import atexit

    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()  # noqa: SLF001 - what the interpreter calls first at exit
    atexit._run_exitfuncs()  # noqa: SLF001
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(code & 0xFF)
