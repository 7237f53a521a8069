#!/bin/bash
# Issue 63 item 4 (strong scaling: throughput lost as micro-batches per step fall) on one GPU: the engine's
# GPT-1B (bench/gpu_mfu.py, eager, flash SDPA, bf16) at micro-batch 1 with 1-16 micro-batches a step (the
# per-step fixed cost against the per-micro-batch cost), and at 8 sequences a step in micro-batches of 1-8.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
for mg in 1:1 1:2 1:4 1:8 1:16 2:8 4:8 8:8; do
  m=${mg%:*}; g=${mg#*:}; t0=$SECONDS
  timeout 80 python3 bench/gpu_mfu.py --rounds 2 --steps 3 --micro $m --global-batch $g > $OUT/mfu-m$m-g$g.log 2>&1
  echo "micro $m global $g rc $? $((SECONDS - t0))s: $(grep -E 'profilers off|minimal loop |breakdown \(ms' $OUT/mfu-m$m-g$g.log | tr '\n' '|')"
done 2>&1 | tee $OUT/summary.txt  # (the committed summary.txt is this output)
