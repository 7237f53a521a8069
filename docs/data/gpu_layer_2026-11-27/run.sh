#!/bin/bash
# Issue 63 item 4 on one GPU: a Megatron GPT layer's shard at tp 1-8 (GEMMs, flash attention, the layer,
# full recomputation: bench/gpu_layer.py), the engine's GPT-1B with and without activation checkpointing
# (bench/gpu_mfu.py), and what a rank holds outside PyTorch once CUDA and one NCCL communicator are up.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
t0=$SECONDS
timeout 200 python3 bench/gpu_layer.py --shapes gpt-22b,gpt-175b --tp 1,2,4,8 --repeats 5 --json $OUT/layer.json 2>&1 | tee $OUT/layer.txt
timeout 60 python3 bench/gpu_layer.py --shapes gpt-530b --tp 4,8 --repeats 5 --json $OUT/layer530.json 2>&1 | tee -a $OUT/layer.txt
echo "layers $((SECONDS - t0))s"
for ac in false true; do
  t0=$SECONDS
  timeout 120 python3 bench/gpu_mfu.py --rounds 3 --steps 3 --set train.activation_checkpointing=$ac 2>&1 | tee $OUT/mfu-ac-$ac.log
  echo "mfu ac=$ac $((SECONDS - t0))s"
done
timeout 60 python3 - <<'PY' 2>&1 | tee $OUT/context.txt
import os, torch, torch.distributed as dist, pynvml
pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)
used = lambda: pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**30
base = used(); torch.cuda.init(); x = torch.ones(1, device="cuda"); a = used()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
dist.all_reduce(x); torch.cuda.synchronize(); b = used()
free, total = torch.cuda.mem_get_info()
print(f"before CUDA {base:.3f} GiB used; CUDA context + 1 tensor {a - base:.3f} GiB; + one NCCL communicator {b - a:.3f} GiB; "
      f"torch reserved {torch.cuda.memory_reserved() / 2**30:.3f} GiB; card {total / 2**30:.2f} GiB; torch {torch.__version__}")
dist.destroy_process_group()
PY
