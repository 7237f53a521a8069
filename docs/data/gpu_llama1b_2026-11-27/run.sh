#!/bin/bash
# issue 62 item 6 on one GPU: the plan's picks run by the engine, and bench/gpu_mfu.py --hf on the same model
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
W="python3 -m workbench.cli --home /tmp/wb"
pick() {
  local p=$1 t0=$SECONDS
  timeout 150 $W run gpu_run/plan-$p.yaml --set train.steps=20 --json > /tmp/run-$p.json 2> /tmp/run-$p.err
  echo "plan-$p rc=$? $((SECONDS - t0))s"; grep -v '^\[transformers' /tmp/run-$p.err | grep -v '^│' | tail -6
  id=$(python3 -c "import json; print(json.load(open('/tmp/run-$p.json'))['run_id'])") || return
  $W show $id --json > $OUT/show-$p${PYTORCH_CUDA_ALLOC_CONF:+-expandable}.json 2>/dev/null
  python3 - $OUT/show-$p${PYTORCH_CUDA_ALLOC_CONF:+-expandable}.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("summary:", d.get("summary"))
print("peak_memory_gib:", d.get("peak_memory_gib"))
print("memory:", d.get("memory"))
import statistics
rows = d.get("breakdown") or []
print("breakdown median (s):", {k: round(statistics.median(r[k] for r in rows[2:]), 4) for k in rows[0] if k not in ("step", "rank")} if rows else None)
PY
}
mfu() {
  local t0=$SECONDS
  timeout $1 python3 bench/gpu_mfu.py --hf examples/llama3_2_1b --seq 2048 --micro $2 --global-batch 16 --rounds 3 --steps 3 ${@:3} 2>&1 | grep -v '^\[transformers' | tee $OUT/mfu-$2${3:+-compile}.log
  echo "mfu $2 $3 $((SECONDS - t0))s"
}
pick 1
pick 2
pick 3
mfu 120 4
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True pick 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
