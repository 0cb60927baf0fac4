#!/usr/bin/env bash
# The main job: run notebooks/01-quickstart.ipynb headless on 2 CPU ranks and
# keep the executed copy, with its printed output and plots, in artifacts/quickstart/
# (ignored by git: a clone stays clean; notebooks/executed/ holds the copies the project commits).
#
#   bash scripts/quickstart.sh             # install what the notebooks need (no browser, no Slurm), then run
#   bash scripts/quickstart.sh --dry-run   # print what it would install and run; change nothing
#
# PYTHON=/path/to/python picks the environment; MNB_SKIP_SETUP=1 skips scripts/setup.sh;
# MNB_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu gets torch's CPU build when torch is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
case "${1:-}" in
  "") ;;
  --dry-run) DRY=1 ;;
  *) echo "quickstart: unknown argument '$1' (only --dry-run)" >&2; exit 2 ;;
esac
if [ "${MNB_SKIP_SETUP:-0}" = 1 ]; then
  echo "quickstart: MNB_SKIP_SETUP=1, nothing installed" >&2
elif [ "$DRY" = 1 ]; then
  bash scripts/setup.sh --for quickstart --dry-run
else
  bash scripts/setup.sh --for quickstart
fi
PY=${PYTHON:-python3}
OUT=artifacts/quickstart
RUN=("$PY" -m jupyter nbconvert --to notebook --execute notebooks/01-quickstart.ipynb
     --ExecutePreprocessor.timeout=900 --output-dir "$OUT")
if [ "$DRY" = 1 ]; then
  echo "quickstart: would run: ${RUN[*]}" >&2
  exit 0
fi
mkdir -p "$OUT"
"${RUN[@]}"
echo "executed notebook: $OUT/01-quickstart.ipynb"
