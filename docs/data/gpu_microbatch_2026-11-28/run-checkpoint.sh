#!/bin/bash
# Where the checkpointed GPT-1B's time goes at micro-batch 1 and 4 (bench/gpu_checkpoint.py), one H100:
# one micro-batch a step (checkpoint.txt), then 8 micro-batches a step accumulated as the engine does
# (checkpoint-acc8.txt; a second device call: `bash run-checkpoint.sh acc8` runs only that one).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
[ "$1" = acc8 ] || timeout 150 python3 bench/gpu_checkpoint.py --micro 1,4 --repeats 5 2>&1 | grep -v Warning | tee $OUT/checkpoint.txt
timeout 100 python3 bench/gpu_checkpoint.py --micro 1 --accumulate 8 --repeats 3 2>&1 | grep -v Warning | tee $OUT/checkpoint-acc8.txt
