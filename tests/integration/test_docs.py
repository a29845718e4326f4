"""The docs stay true: every command in a ```bash block of README.md and docs/*.md runs here, and succeeds.

What a page may put in a ```bash block (a trailing backslash joins lines; ``# ...`` comments are stripped):

- commands that run kdsweep: ``python -m kdsweep…``, ``kdsweep …``, ``torchrun … -m kdsweep …``,
  ``python benchmarks/…`` or ``bash benchmarks/…``, each possibly after ``VAR=value`` assignments;
- the README's setup commands (``python3 -m venv …``), which CI runs (.ci/run) and this test skips.

Anything else in a bash block fails the test: a command that cannot run here (it needs a GPU, a network, several
nodes, or an hour) goes in a ```text block with a sentence saying why. ``$VARS`` stand for the user's own files,
which each page names at its top; here they are tiny stand-ins (:func:`stand_ins`). A ```text block right after a
```bash block whose first line is ``kdsweep: error: …`` is what that block's last command prints: it must exit 2
with exactly that line on stderr.

How they run: the pages in ``PAGES`` order, in one working directory, as a reader would in one checkout (the
README's sweep is docs/sweeps.md's first, and docs/analysis.md reads that sweep), with ``benchmarks/`` and
``notebooks/`` linked from the repository so that a command written for the repository's root runs as written; each
command once (one that a later page repeats is not run again), in bash (``set -u``: a variable no stand-in sets
fails), with this virtualenv first on PATH, the session's ``KDSWEEP_CACHE`` (the embedded zoo is built once),
``OMP_NUM_THREADS=1``, an ``HF_HOME`` of its own read offline, and a timeout. ``kdsweep dashboard`` serves until
stopped: it is stopped once its API answers. Each page must hold at least the commands ``PAGES`` counts, so that a
page cannot lose its commands unnoticed, and a benchmark run here must write its JSON elsewhere (``--out``).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import REPO, free_port

pytestmark = pytest.mark.slow

# Each page, in the order a reader meets them, with the least number of commands its bash blocks hold.
PAGES = {
    "README.md": 4,
    "docs/models.md": 3,
    "docs/data.md": 1,
    "docs/distillation.md": 2,
    "docs/cache.md": 2,
    "docs/sweeps.md": 5,
    "docs/workers.md": 2,
    "docs/packing.md": 2,
    "docs/slurm.md": 2,
    "docs/analysis.md": 2,
    "docs/gpus.md": 1,
    "docs/benchmarks.md": 1,
}
AFTER = {"docs/analysis.md": ["docs/sweeps.md"]}  # $SWEEP is the sweep docs/sweeps.md makes
SETUP = "python3 -m venv"  # the README's two commands: CI runs them (.ci/run)
COMMAND = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*"
                     r"(?:python -m kdsweep\b|kdsweep\s|torchrun\s.*-m kdsweep\b|python benchmarks/|bash benchmarks/)")
TIMEOUT_S = 420
TEMPLATE = REPO / "tests" / "data" / "chat_templates" / "qwen2_5.jinja"


@dataclass
class Command:
    page: str
    text: str
    expect_error: str | None = None  # the one line it must print (exit code 2), from the text block after it


@dataclass
class Ran:
    command: Command
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    repeated_from: str | None = None  # the page that ran the same command first

    def report(self) -> str:
        return (f"{self.command.page}: `{self.command.text}` -> exit {self.returncode} in {self.seconds:.1f} s\n"
                f"--- stdout (tail)\n{self.stdout[-3000:]}\n--- stderr (tail)\n{self.stderr[-3000:]}")


def _strip_comment(line: str) -> str:
    """``line`` without a shell comment (a ``#`` at the start or after a blank, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def blocks(markdown: str) -> list[tuple[str, list[str]]]:
    """The fenced blocks of a page, in order: (language, lines)."""
    found, lang, body = [], None, []
    for line in markdown.splitlines():
        if lang is None and line.startswith("```"):
            lang, body = line[3:].strip(), []
        elif lang is not None and line.startswith("```"):
            found.append((lang, body))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, "a fenced block is not closed"
    return found


def commands(page: str) -> tuple[list[Command], int]:
    """The commands of a page's bash blocks, and how many setup commands it skipped; any other line fails."""
    found, skipped = [], 0
    fenced = blocks((REPO / page).read_text())
    for n, (lang, body) in enumerate(fenced):
        if lang != "bash":
            continue
        joined, pending = [], ""
        for line in body:
            pending += line
            if pending.rstrip().endswith("\\"):
                pending = pending.rstrip()[:-1] + " "
                continue
            joined.append(pending)
            pending = ""
        assert not pending, f"{page}: a bash block ends in a continued line"
        in_block = []
        for line in joined:
            text = " ".join(_strip_comment(line).split())
            if not text:
                continue
            if text.startswith(SETUP):
                skipped += 1
                continue
            assert COMMAND.match(text), (
                f"{page}: `{text}` is in a bash block but does not run kdsweep; every command in a bash block is run "
                "by this test, so a command that cannot run here belongs in a ```text block, with why")
            in_block.append(Command(page, text))
        following = fenced[n + 1] if n + 1 < len(fenced) else None
        if in_block and following and following[0] == "text" and following[1] and \
                following[1][0].startswith("kdsweep: error:"):
            in_block[-1].expect_error = "\n".join(following[1]).strip()
        found += in_block
    return found, skipped


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory, zoo_dirs, other_teacher):
    """The user's files the pages name, as tiny stand-ins: the embedded zoo's directories (the student with a
    ChatML template, as an instruct model carries one), the same as hub ids in an offline Hugging Face cache, a
    folder of checkpoints under the presets' names, and small instruction and chat data from the corpus."""
    from transformers import AutoTokenizer

    from kdsweep.data.text import EMBEDDED_CORPUS
    from test_hf_models import cache_model

    root = tmp_path_factory.mktemp("stand_ins")
    student = root / "student"
    shutil.copytree(zoo_dirs["student"], student)
    (student / "kdsweep_zoo.json").unlink()  # a plain Hugging Face directory, as a user's is
    tok = AutoTokenizer.from_pretrained(student)
    tok.chat_template = TEMPLATE.read_text()
    tok.save_pretrained(student)
    hf_home = root / "hf_home"
    cache_model(hf_home, "kdsweep-docs/tiny-student", student)
    cache_model(hf_home, "kdsweep-docs/tiny-teacher", zoo_dirs["teacher"])
    ckpts = root / "ckpts"
    ckpts.mkdir()
    (ckpts / "Qwen2.5-0.5B-Instruct").symlink_to(student)  # the chat recipes' student
    (ckpts / "Qwen2.5-7B-Instruct").symlink_to(zoo_dirs["teacher"])

    words = EMBEDDED_CORPUS.read_text().split()
    rng = random.Random(0)
    text = lambda n: " ".join(words[(k := rng.randrange(len(words) - n)): k + n])  # noqa: E731
    alpaca = root / "alpaca.jsonl"
    alpaca.write_text("".join(json.dumps({"instruction": text(8), "input": text(rng.choice([0, 5])),
                                          "output": text(rng.randint(10, 60))}) + "\n" for _ in range(120)))
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [m for _ in range(1 + k % 2) for m in (
        {"role": "user", "content": text(6)}, {"role": "assistant", "content": text(rng.randint(4, 30))})]}) + "\n"
        for k in range(120)))
    template = root / "chatml.jinja"
    template.write_text(TEMPLATE.read_text())
    return {
        "variables": {"STUDENT": str(student), "TEACHER": str(zoo_dirs["teacher"]),
                      "STUDENT_ID": "kdsweep-docs/tiny-student", "TEACHER_ID": "kdsweep-docs/tiny-teacher",
                      "CKPTS": str(ckpts), "CHATS": str(chats),
                      "ALPACA": str(alpaca), "TEMPLATE": str(template), "SWEEP": "sweeps/first"},
        "hf_home": hf_home,
    }


@dataclass
class Reader:
    """Runs the pages' commands as a reader would, in one working directory; each page once, each command once."""

    workdir: Path
    env: dict[str, str]
    done: dict[str, list[Ran]] = field(default_factory=dict)
    seen: dict[str, str] = field(default_factory=dict)  # command -> the page that ran it

    def page(self, page: str) -> list[Ran]:
        if page not in self.done:
            for before in AFTER.get(page, []):
                self.page(before)
            found, _ = commands(page)
            self.done[page] = [self.run(c) for c in found]
        return self.done[page]

    def run(self, command: Command) -> Ran:
        if command.text in self.seen:
            return Ran(command, 0, repeated_from=self.seen[command.text])
        self.seen[command.text] = command.page
        start = time.monotonic()
        if re.match(r"^kdsweep dashboard\b", command.text):
            ran = self._serve(command)
        else:
            proc = subprocess.run(["bash", "-uc", command.text], cwd=self.workdir, env=self.env, capture_output=True,
                                  text=True, timeout=TIMEOUT_S)
            ran = Ran(command, proc.returncode, proc.stdout, proc.stderr)
        ran.seconds = time.monotonic() - start
        print(f"{ran.seconds:6.1f} s  {command.page}: {command.text}", flush=True)
        return ran

    def _serve(self, command: Command) -> Ran:
        """``kdsweep dashboard``: serve, wait until its API answers, stop it (a free port for the one written)."""
        port = free_port()
        text = re.sub(r"--port \d+", f"--port {port}", command.text)
        proc = subprocess.Popen(["bash", "-uc", f"exec {text}"], cwd=self.workdir, env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        deadline, served = time.monotonic() + 120, False
        while not served and proc.poll() is None and time.monotonic() < deadline:
            try:
                served = urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5).status == 200
            except OSError:
                time.sleep(0.3)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        return Ran(command, 0 if served else (proc.returncode or 1), out, "" if served else "its API never answered")


@pytest.fixture(scope="module")
def reader(tmp_path_factory, stand_ins, slurm_cluster):
    workdir = tmp_path_factory.mktemp("docs")
    for name in ("benchmarks", "notebooks"):  # the commands are written for the repository's root
        (workdir / name).symlink_to(REPO / name)
    env = {**os.environ, **stand_ins["variables"], "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "HF_HOME": str(stand_ins["hf_home"]), "HF_HUB_OFFLINE": "1",
           "GPU_CHECK_WORK": str(workdir / "gpu_check_work")}
    env.pop("WANDB_API_KEY", None)  # W&B offline, as on a compute node
    env.pop("OUT", None)  # benchmarks/gpu/check.py also writes to $OUT when it is set
    return Reader(workdir, env)


def test_every_page_is_listed_and_the_readme_stays_short():
    assert {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")} == set(PAGES) - {"README.md"}
    assert len((REPO / "README.md").read_text().splitlines()) < 200
    found, skipped = commands("README.md")
    assert skipped == 2, "the README's two setup commands (python3 -m venv ...) are in a bash block"


@pytest.mark.parametrize("page", list(PAGES))
def test_the_commands_of_a_page_run(page, reader):
    found, _ = commands(page)
    assert len(found) >= PAGES[page], f"{page} has {len(found)} commands in bash blocks, fewer than {PAGES[page]}"
    for c in found:  # the repository's results are what the docs quote: a benchmark run here writes elsewhere
        assert not re.search(r"python benchmarks/", c.text) or "--out " in c.text, f"{page}: `{c.text}` needs --out"
    ran = reader.page(page)
    failures = []
    for r in ran:
        if r.repeated_from:
            continue
        if r.command.expect_error:
            if r.returncode != 2 or r.stderr.strip() != r.command.expect_error:
                failures.append(f"expected exit 2 and the one line\n{r.command.expect_error}\n" + r.report())
        elif r.returncode != 0:
            failures.append(r.report())
    assert not failures, "\n\n".join(failures)
