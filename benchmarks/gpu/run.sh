#!/usr/bin/env bash
# On the GPU machine (no network): install the wheels prepare.sh fetched, then run every check within 8 minutes.
# Writes benchmarks/results/gpu.json and, when $OUT is set, $OUT/gpu.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$site" .whl/*.whl
export PYTHONPATH="$PWD:$PWD/launchers:$site${PYTHONPATH:+:$PYTHONPATH}"
export KDSWEEP_CACHE=${KDSWEEP_CACHE:-$(mktemp -d)} GPU_CHECK_WORK=$(mktemp -d) HF_HUB_OFFLINE=1
mkdir -p "$KDSWEEP_CACHE/zoo" && cp -r .whl/zoo/. "$KDSWEEP_CACHE/zoo/"   # the embedded models prepare.sh built
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 520 python3 benchmarks/gpu/check.py "$@"
