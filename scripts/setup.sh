#!/usr/bin/env bash
# Install mnb and what it needs into the current Python environment
# (PYTHON=/path/to/python picks another one, e.g. .ci/run's .venv-312/bin/python).
#
# torch is installed first, pinned, only when it is missing.  A CPU build of
# torch==2.13.0 is used when one lies on local disk (pip's find-links; the
# project's machines have one for Python 3.11); otherwise pip gets torch==2.13.0
# from PyPI, which is a CUDA build: about 4.5 GB with its nvidia-* packages
# (it runs on CPU too).  megatron-core then resolves by Python version
# (0.16.1 on 3.11, 0.19.x on 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH="torch==2.13.0"
if ! "$PY" -c "import torch" 2>/dev/null; then
  # A local build (e.g. 2.13.0+cpu) wins over PyPI's 2.13.0: pip prefers the local version label.
  if ! "$PY" -m pip install -q --dry-run --no-deps --no-index "$TORCH" >/dev/null 2>&1; then
    echo "setup: no local CPU build of $TORCH for $("$PY" -c 'import sys; print("Python %d.%d" % sys.version_info[:2])');" \
         "installing PyPI's CUDA build (about 4.5 GB with its nvidia-* packages; it runs on CPU too)" >&2
  fi
  "$PY" -m pip install -q "$TORCH"
fi
# Reinstall when anything is missing, or when `mnb` resolves to another checkout.
if ! "$PY" -I -c "import mnb, megatron.core, nbclient, pytest_timeout, safetensors, tokenizers, transformers, os, sys; \
sys.exit(os.path.dirname(os.path.abspath(mnb.__file__)) != os.path.abspath('mnb'))" 2>/dev/null \
   || [ "${MNB_REINSTALL:-0}" = 1 ]; then
  "$PY" -m pip install -q -e ".[test]"
fi

# ---- browser test (tests/browser): Debian's Chromium + the playwright Python package ----
# Never `playwright install` (it downloads its own browser); the test drives /usr/bin/chromium.
# Best effort: without them the browser test installs them itself, or skips with the reason.
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo -n"
  ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "setup: could not install chromium with apt-get; the browser test will be skipped" >&2
fi
if ! "$PY" -c "import playwright.sync_api" 2>/dev/null; then
  "$PY" -m pip install -q playwright || echo "setup: could not pip install playwright" >&2
fi

# ---- Slurm (tests/controller/test_slurm.py): Debian's slurm-wlm (slurmctld, slurmd, slurm-client) + munge ----
# The tests start their own one-node cluster on localhost (tests/slurm_local.py); nothing is
# configured or started here.  Skipped when installed; without it those tests skip with the reason.
if ! { command -v sbatch && command -v slurmctld && command -v slurmd && command -v munged; } >/dev/null 2>&1 \
   && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo -n"
  ($SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
      slurmctld slurmd slurm-client munge) >/dev/null 2>&1 \
    || echo "setup: could not install Slurm with apt-get; the Slurm tests will be skipped" >&2
fi
