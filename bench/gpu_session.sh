#!/usr/bin/env bash
# Every GPU check of a change in one call on the lent device machine (one H200, no internet):
#
#   run(command="MNB_GPU_STEPS=start,smoke,run_script bash bench/gpu_session.sh", carry=[".whl"])
#
# .whl/ holds the wheels the machine lacks (megatron-core 0.19.2 for Python 3.12, pyzmq,
# pytest and its dependencies); they go to /tmp/site, never into the system Python.
# Each step writes its own file under $OUT (default ./gpu-out) and a failing step
# does not stop the others; the table at the end says what ran and how it ended.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1
python3 -c "import sys, torch, megatron.core as m; print(sys.version.split()[0], torch.__version__, m.__version__)" \
  >>"$OUT/gpu.txt" 2>&1

declare -a ROWS=()
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local start=$SECONDS rc=0
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  ROWS+=("$(printf '%-24s exit %-4s %4ds' "$name" "$rc" $((SECONDS - start)))")
}

# MNB_GPU_STEPS picks steps (one call is at most 10 minutes): "start" first, while the machine is cold.
STEPS=${MNB_GPU_STEPS:-start,smoke,run_script}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
has start && step h200_start 240 python3 bench/h200_limits.py --sections start --out "$OUT/h200_start"
has smoke && step gpu_smoke_tests 100 python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/test_gpu_smoke.py
has run_script && step run_script 200 python3 bench/gpu_run_script.py --gpus 1 --out "$OUT/run_script.json"
has mfu && step h200_mfu 560 python3 bench/h200_limits.py --sections think,mfu,profile,plain --out "$OUT/h200_mfu"
has probe && step oom_probe 150 python3 bench/gpu_oom_probe.py
has probe && step import_time 60 bash bench/gpu_import_time.sh
has profile && step h200_profile 200 python3 bench/h200_limits.py --sections profile,adam --out "$OUT/h200_profile"
has cp_attention && step cp_attention 150 python3 bench/gpu_cp_attention.py --json "$OUT/cp_attention.json"
# issue 39's open rows (2026-12-05): the start in three orders from a cold page cache (first, while the machine
# is cold), mnb's Triton kernels (RMSNorm, SwiGLU, RoPE, loss) alone and in whole steps (all four against
# Inductor's: own_mfu; each: kernel_mfu), FP8 after the cast-transpose, the all-unfused first run.
# One call is at most 600 s: the plans in BENCHMARKS.md group steps whose limits add up to less.
has start_orders && step start_orders 300 python3 bench/start_orders.py --drop-page-cache --out "$OUT/start"
has kernels && step train_kernels 120 python3 bench/train_kernels.py --out "$OUT/kernels"
has own_mfu && step own_mfu 360 python3 bench/h200_limits.py --sections own --out "$OUT/own_mfu"
has kernel_mfu && step kernel_mfu 560 python3 bench/h200_limits.py --sections norm,swiglu,rope,loss \
  --norm-models llama-3b:8 --swiglu-models llama-3b:8 --rope-models llama-3b:8 --loss-models llama-3b:8 \
  --out "$OUT/kernel_mfu"
has own_profile && step own_profile 220 python3 bench/h200_limits.py --sections own,profile --own-order on \
  --own-models llama-3b:8,llama-1b:16 --out "$OUT/own_profile"
has norm_mfu && step norm_mfu 200 python3 bench/h200_limits.py --sections norm --out "$OUT/norm_mfu"
has fp8 && step fp8_speed 460 python3 bench/gpu_fp8.py --sections speed,profile --out "$OUT/fp8"
has fp8_delayed && step fp8_delayed 500 python3 bench/gpu_fp8.py --sections cast,speed,profile,loss \
  --recipes bf16,tensorwise,delayed --out "$OUT/fp8_delayed"
has first_run && step first_run_1b 280 python3 bench/h200_first_run.py --llama-1b --out "$OUT/first_run"

printf '%s\n' "${ROWS[@]}" | tee "$OUT/steps.txt"
