#!/usr/bin/env bash
# The device check on a GPU machine without network, beside the torch it already has. The wheels listed in
# benchmarks/gpu_wheels.txt (fetched here with --fetch-wheels, where pip reaches PyPI) install with --no-index
# --no-deps into a folder of their own that goes first on PYTHONPATH; nothing else is installed. Then
# benchmarks/gpu_check.py runs with the arguments given (e.g. --out PATH); its exit status is this script's.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fetch-wheels" ]; then
    grep -v '^#' benchmarks/gpu_wheels.txt | xargs python3 -m pip download -q --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl
    exit 0
fi
site=${MINIFAAS_GPU_SITE:-/tmp/minifaas-gpu-site}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec python3 benchmarks/gpu_check.py "$@"
