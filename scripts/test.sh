#!/usr/bin/env bash
# The test suite: unit tests plus real CPU rank pools, notebooks and a browser test.
# GPU tests (marked `gpu`) are skipped here; bench/gpu_checks.py runs them on GPUs.
# Arguments go to pytest; PYTHON=/path/to/python picks the environment (default python3);
# MNB_SKIP_SETUP=1 skips scripts/setup.sh (.ci/run has just run it).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${MNB_SKIP_SETUP:-0}" = 1 ] || bash scripts/setup.sh --for tests
PY=${PYTHON:-python3}
exec "$PY" -m pytest -q "$@"
