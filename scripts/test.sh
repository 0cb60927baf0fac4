#!/usr/bin/env bash
# The test suite: unit tests plus real CPU rank pools, notebooks and a browser test.
# GPU tests (marked `gpu`) are skipped here; bench/gpu_checks.py runs them on GPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
exec "$PY" -m pytest -q "$@"
