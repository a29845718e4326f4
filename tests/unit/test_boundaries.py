"""DESIGN.md's import contracts: config is pure, train never sees hydra/submitit/optuna, --help needs no torch."""

import subprocess
import sys

import pytest


def imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    names = set(out.split())
    return names | {m.split(".")[0] for m in names}


@pytest.mark.parametrize(
    "module,forbidden",
    [
        ("kdsweep.config", {"torch", "hydra", "omegaconf"}),
        ("kdsweep.models.check", {"torch", "hydra", "omegaconf"}),
        ("kdsweep.hub", {"torch", "hydra", "omegaconf", "huggingface_hub"}),
        ("kdsweep.teacher.check", {"torch", "hydra", "omegaconf"}),
        ("kdsweep.data.key", {"torch", "hydra", "omegaconf", "datasets"}),
        ("kdsweep.sweep.cost", {"torch", "optuna"}),
        ("kdsweep.data.check", {"torch", "hydra", "omegaconf", "datasets", "pyarrow"}),
        ("kdsweep.app", {"torch", "transformers", "peft"}),
        ("kdsweep.startup", {"torch", "transformers", "peft", "hydra", "kdsweep.config"}),  # imported before them
        ("kdsweep.train", {"hydra", "omegaconf", "submitit", "optuna"}),
        ("kdsweep.distributed.launch", {"hydra", "omegaconf", "submitit", "optuna"}),
        ("kdsweep.distributed.signals", {"hydra", "omegaconf", "submitit", "optuna"}),
        ("kdsweep.sweep.space", {"torch", "optuna"}),
        ("kdsweep.losses", {"hydra", "omegaconf", "transformers", "peft", "kdsweep.config"}),
        ("kdsweep.losses.cross_tokenizer", {"hydra", "omegaconf", "transformers", "tokenizers", "kdsweep.config"}),
        ("kdsweep.teacher.align", {"torch", "transformers", "tokenizers", "hydra", "omegaconf"}),
        ("kdsweep.evaluation.report", {"torch", "transformers", "lm_eval"}),  # `kdsweep eval --help` loads no model code
    ],
)
def test_module_does_not_import(module, forbidden):
    loaded = imported_after(f"import {module}")
    assert not (forbidden & loaded), forbidden & loaded


def test_help_path_imports_no_torch():
    code = (
        "import sys, runpy; sys.argv = ['kdsweep', '--help']\n"
        "try:\n    runpy.run_module('kdsweep', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported by --help'\nprint('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr


def test_benchmarks_use_only_kdsweep_s_public_names():
    """The GPU check and the benchmarks build what jobs build through kdsweep's public functions, so a refactor of
    a private helper cannot silently change what they measure."""
    import ast
    from pathlib import Path

    private = []
    for path in sorted((Path(__file__).parents[2] / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kdsweep"):
                private += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not private, private
