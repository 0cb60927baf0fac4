#!/usr/bin/env bash
# Where a rank's Megatron-Core import goes on this machine: the 15 slowest modules (cumulative).
python3 -X importtime -c "import torch; import megatron.core.models.gpt, megatron.core.optimizer, megatron.core.pipeline_parallel" 2>&1 \
  | sort -t'|' -k2 -n | tail -25
