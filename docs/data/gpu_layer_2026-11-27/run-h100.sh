#!/bin/bash
# The same shards on an H100 (the dgx-h100 preset's GPU, like for like), GPT 175B at seq 2048 and Llama 3.1
# 8B / 70B at seq 8192 (SwiGLU, GQA, rotary, RMSNorm), and what a rank holds outside PyTorch on this card.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee $OUT/h100-gpu.txt
t0=$SECONDS
timeout 100 python3 bench/gpu_layer.py --shapes gpt-175b --tp 1,2,4,8 --repeats 5 --json $OUT/h100-gpt.json 2>&1 | tee $OUT/h100-layer.txt
timeout 150 python3 bench/gpu_layer.py --shapes llama-8b,llama-70b --tp 1,2,4,8 --seq 8192 --repeats 5 --json $OUT/h100-llama.json 2>&1 | tee -a $OUT/h100-layer.txt
echo "layers $((SECONDS - t0))s"
timeout 60 python3 - <<'PY' 2>&1 | tee $OUT/h100-context.txt
import os, torch, torch.distributed as dist, pynvml
pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)
used = lambda: pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**30
base = used(); torch.cuda.init(); x = torch.ones(1, device="cuda"); a = used()
y = torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda"); torch.cuda.synchronize(); g = used()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
dist.all_reduce(x); torch.cuda.synchronize(); b = used()
free, total = torch.cuda.mem_get_info()
print(f"before CUDA {base:.3f} GiB used; CUDA context + 1 tensor {a - base:.3f} GiB; + cuBLAS (one GEMM) {g - a:.3f} GiB; "
      f"+ one NCCL communicator {b - g:.3f} GiB; torch reserved {torch.cuda.memory_reserved() / 2**30:.3f} GiB; "
      f"card {total / 2**30:.2f} GiB; torch {torch.__version__}")
dist.destroy_process_group()
PY
