#!/usr/bin/env bash
# Run here (with a network): fetch the wheels the GPU machine lacks, for its Python 3.12, into .whl/ (git-ignored),
# at the versions installed here, and the embedded models. Then: run(command="bash benchmarks/gpu/run.sh", carry=[".whl"]).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
# kdsweep's job path needs Hydra (and its config parser); Hydra's plugin scan finds the submitit launcher.
pkgs=$($PY -c '
from importlib.metadata import version
for name in ["hydra-core", "omegaconf", "antlr4-python3-runtime", "submitit", "hydra-submitit-launcher", "cloudpickle"]:
    print(f"{name}=={version(name)}")')
rm -rf .whl && mkdir .whl
for pkg in $pkgs; do
  # a pure-Python package published only as a source archive (antlr4 4.9.3) is built into a wheel here
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 -d .whl "$pkg" 2>/dev/null \
    || $PY -m pip wheel -q --no-deps -w .whl "$pkg"
done
# the embedded models, built here (their first build pre-trains them: minutes of the GPU machine's time otherwise)
$PY -c '
import shutil, sys
from pathlib import Path
from kdsweep.models import zoo
for built in (zoo.tokenizer_dir(), zoo.model_dir("tiny-student"), zoo.model_dir("tiny-teacher")):
    shutil.copytree(built, Path(".whl/zoo") / built.name)'
ls .whl .whl/zoo
du -sh .whl
