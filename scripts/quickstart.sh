#!/usr/bin/env bash
# The main job: run notebooks/01-quickstart.ipynb headless on 2 CPU ranks and
# keep the executed copy, with its printed output and plots, in notebooks/executed/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
mkdir -p notebooks/executed
"$PY" -m jupyter nbconvert --to notebook --execute notebooks/01-quickstart.ipynb \
  --ExecutePreprocessor.timeout=900 --output-dir notebooks/executed
echo "executed notebook: notebooks/executed/01-quickstart.ipynb"
