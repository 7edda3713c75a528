#!/usr/bin/env bash
# The device check on a one-GPU machine without network: a venv from the wheels in .whl/ (if there),
# then benchmarks/gpu_check.py, which writes gpu_check.json and exits 1 if a step failed (its exit status is
# this script's). Arguments go on to it (e.g. --out PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
    if [ -d .whl ]; then .venv/bin/pip install -q --no-index --find-links .whl torch==2.13.0 -e ".[gpu,test]"; fi
fi
exec timeout 500 .venv/bin/python benchmarks/gpu_check.py "$@"
