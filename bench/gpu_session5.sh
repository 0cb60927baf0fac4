#!/bin/bash
# One device call for the session of 2026-12-02: issue 27's H200 rows (first: the machine is cold),
# issue 29's Flight Recorder read-out through a CUDA pool, issue 28's profiled step with HTA.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -c "import pandas, numpy, yaml, psutil, dateutil" 2>/dev/null || \
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/ifmissing/*.whl
export PYTHONPATH=/tmp/site:$PWD
export XDG_CACHE_HOME=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, megatron.core, hta; print(torch.__version__, megatron.core.__version__)"
timeout 280 python3 bench/h200_standby.py --out $OUT/standby; echo "standby rc=$?"
timeout 60 python3 bench/gpu_fr_pool.py --out $OUT/fr_pool.json; echo "fr rc=$?"
timeout 200 python3 bench/gpu_profile.py --out $OUT/profile/profile.json; echo "profile rc=$?"
