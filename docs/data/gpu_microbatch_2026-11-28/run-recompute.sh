#!/bin/bash
# The same GPT-1B on one H100 under full activation checkpointing (train.activation_checkpointing=true) at
# micro-batch 1 and 4 with 8 sequences a step: the recompute path of the engine flavour's eager fixed costs.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee $OUT/gpu-recompute.txt
for m in 1 4; do
  t0=$SECONDS
  timeout 80 python3 bench/gpu_mfu.py --rounds 2 --steps 3 --micro $m --global-batch 8 \
    --set train.activation_checkpointing=true > $OUT/mfu-ac-m$m-g8.log 2>&1
  echo "recompute micro $m global 8 rc $? $((SECONDS - t0))s: $(grep -E 'profilers off|minimal loop |breakdown \(ms' $OUT/mfu-ac-m$m-g8.log | tr '\n' '|')"
done 2>&1 | tee $OUT/summary-recompute.txt  # (the committed summary-recompute.txt is this output)
