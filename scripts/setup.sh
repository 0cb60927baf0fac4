#!/usr/bin/env bash
# Install mnb and what it needs into the current Python environment
# (PYTHON=/path/to/python picks another one, e.g. .ci/run's .venv-312/bin/python).
#
#   bash scripts/setup.sh --for quickstart   # what the notebooks need (scripts/quickstart.sh)
#   bash scripts/setup.sh [--for tests]      # that, the test extras, a browser and Slurm (scripts/test.sh, CI)
#   bash scripts/setup.sh --for quickstart --dry-run   # print the plan, install nothing
#
# Each step says what it installs and roughly how much it downloads before it starts, and pip
# shows its progress.  torch is installed first, pinned, only when it is missing: a CPU build of
# torch==2.13.0 when one lies on local disk (pip's find-links; the project's machines have one
# for Python 3.11), else from MNB_TORCH_INDEX_URL when set (e.g. PyTorch's CPU wheels,
# https://download.pytorch.org/whl/cpu: a few hundred MB), else PyPI's CUDA build: about 4.5 GB
# with its nvidia-* packages (it runs on CPU too).  megatron-core then resolves by Python
# version (0.16.1 on 3.11, 0.19.x on 3.12).  Only the tests need Chromium (tests/browser) and
# Slurm with munge (tests/controller/test_slurm.py): apt-get installs them in the tests mode only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODE=tests
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --for) MODE=${2:-}; shift 2 || { echo "setup: --for needs quickstart or tests" >&2; exit 2; } ;;
    --for=*) MODE=${1#--for=}; shift ;;
    --dry-run) DRY=1; shift ;;
    *) echo "setup: unknown argument '$1' (use --for quickstart|tests, --dry-run)" >&2; exit 2 ;;
  esac
done
case "$MODE" in
  quickstart|tests) ;;
  *) echo "setup: --for takes quickstart or tests, not '$MODE'" >&2; exit 2 ;;
esac

say() { echo "setup: $*" >&2; }
# do CMD...: run it, or in a dry run only say it would.
do_() { if [ "$DRY" = 1 ]; then say "  would run: $*"; else "$@"; fi; }
PIP=("$PY" -m pip install --progress-bar on)
say "mode '$MODE'$([ "$DRY" = 1 ] && echo ' (dry run: nothing is installed)') into $PY"

TORCH="torch==2.13.0"
if "$PY" -c "import torch" 2>/dev/null; then
  say "torch: present, kept"
elif "$PY" -m pip install -q --dry-run --no-deps --no-index "$TORCH" >/dev/null 2>&1; then
  # A local build (e.g. 2.13.0+cpu) wins over PyPI's 2.13.0: pip prefers the local version label.
  say "torch: installing $TORCH from the local CPU build pip finds (no download)"
  do_ "${PIP[@]}" "$TORCH"
elif [ -n "${MNB_TORCH_INDEX_URL:-}" ]; then
  say "torch: installing $TORCH from $MNB_TORCH_INDEX_URL (the CPU build: a few hundred MB)"
  do_ "${PIP[@]}" "$TORCH" --index-url "$MNB_TORCH_INDEX_URL"
else
  say "torch: installing $TORCH from PyPI: the CUDA build, about 4.5 GB with its nvidia-* packages" \
      "(it runs on CPU too). Without a GPU, stop it (Ctrl-C) and get the CPU build (a few hundred MB):" \
      "MNB_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/quickstart.sh"
  do_ "${PIP[@]}" "$TORCH"
fi

EXTRAS=""; WANT="import mnb, megatron.core, safetensors, tokenizers, nbconvert"
if [ "$MODE" = tests ]; then
  EXTRAS="[test]"; WANT="$WANT, nbclient, pytest_timeout, transformers, hta"  # hta: HolisticTraceAnalysis
fi
# Reinstall when anything is missing, or when `mnb` resolves to another checkout (say which: the install
# replaces it for this Python).
OTHER=$("$PY" -I -c "import os, mnb; d = os.path.dirname(os.path.dirname(os.path.abspath(mnb.__file__))); \
print(d if d != os.path.abspath('.') else '')" 2>/dev/null || true)
if ! "$PY" -I -c "$WANT, os, sys; \
sys.exit(os.path.dirname(os.path.abspath(mnb.__file__)) != os.path.abspath('mnb'))" 2>/dev/null \
   || [ "${MNB_REINSTALL:-0}" = 1 ]; then
  [ -n "$OTHER" ] && say "mnb: this Python's mnb is the one in $OTHER; installing this checkout replaces it" \
      "(PYTHON=/path/to/another/python keeps it)"
  if [ "$MODE" = tests ]; then
    say "mnb: installing this checkout with its test extras (megatron-core, JupyterLab, matplotlib," \
        "pytest, transformers, playwright, ...): roughly 200 MB to download where none is present"
  else
    say "mnb: installing this checkout (megatron-core, JupyterLab, matplotlib, ...): roughly 100 MB" \
        "to download where none is present"
  fi
  do_ "${PIP[@]}" -e ".$EXTRAS"
else
  say "mnb: this checkout is installed with what mode '$MODE' needs, kept"
fi

if [ "$MODE" = quickstart ]; then
  say "done: no browser and no Slurm (only the tests need them: bash scripts/test.sh installs them)"
  exit 0
fi

SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo -n"
have_apt() { command -v apt-get >/dev/null 2>&1; }

# ---- browser test (tests/browser): Debian's Chromium + the playwright Python package ----
# Never `playwright install` (it downloads its own browser); the test drives /usr/bin/chromium.
# Best effort: without them the browser test installs them itself, or skips with the reason.
if [ -x /usr/bin/chromium ]; then
  say "chromium (browser test): present, kept"
elif have_apt; then
  say "chromium (browser test): installing Debian's chromium with apt-get (about 120 packages with its libraries)"
  if [ "$DRY" = 1 ]; then say "  would run: apt-get install chromium"; else
    ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium) >/dev/null 2>&1 \
      || say "could not install chromium with apt-get; the browser test will be skipped"
  fi
else
  say "chromium (browser test): missing and no apt-get; the browser test will be skipped"
fi
if ! "$PY" -c "import playwright.sync_api" 2>/dev/null; then
  say "playwright (browser test): installing the Python package (about 40 MB; no browser download)"
  do_ "${PIP[@]}" playwright || say "could not pip install playwright"
fi

# ---- Slurm (tests/controller/test_slurm.py): Debian's slurm-wlm (slurmctld, slurmd, slurm-client) + munge ----
# The tests start their own cluster on localhost (tests/slurm_local.py): two slurmd on this host,
# nodes n1 and n2 on ports of their own (Debian's 22.05 build runs them), so a pool's job spans
# two "nodes"; by hand: python -m tests.slurm_local start /tmp/mnb-slurm --nodes 2.  Nothing is
# configured or started here.  Skipped when installed; without it those tests skip with the reason.
if { command -v sbatch && command -v slurmctld && command -v slurmd && command -v munged; } >/dev/null 2>&1; then
  say "slurm + munge (Slurm tests): present, kept"
elif have_apt; then
  say "slurm + munge (Slurm tests): installing slurmctld slurmd slurm-client munge with apt-get (and their libraries)"
  if [ "$DRY" = 1 ]; then say "  would run: apt-get install slurmctld slurmd slurm-client munge"; else
    ($SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge) >/dev/null 2>&1 \
      || say "could not install Slurm with apt-get; the Slurm tests will be skipped"
  fi
else
  say "slurm + munge (Slurm tests): missing and no apt-get; the Slurm tests will be skipped"
fi
