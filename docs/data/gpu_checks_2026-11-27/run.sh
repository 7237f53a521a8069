#!/bin/bash
# Stop 70 on one GPU: (1) plan-1 of 2026-11-27 as exported, under the engine's allocator default, on a
# GPU capped to what torch could allocate on the H100 it OOMed on (78.46 GiB), beside the user-set
# old default (expandable_segments:False), which should OOM as it did there; (2) the suite's GPU tests.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a $OUT/gpu.txt
mkdir -p /tmp/cap && cat > /tmp/cap/sitecustomize.py <<'PY'
import os
if os.environ.get("CAP_GIB") and "LOCAL_RANK" in os.environ:  # rank processes only (torchrun sets it)
    import torch
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(float(os.environ["CAP_GIB"]) * 2**30 / total)
    print(f"[cap] allocator capped at {os.environ['CAP_GIB']} GiB of {total / 2**30:.2f}", flush=True)
PY
W="python3 -m workbench.cli --home /tmp/wb"
capped() {  # $1 label; the rest: env for the run
  local label=$1 t0=$SECONDS; shift
  env "$@" CAP_GIB=78.46 PYTHONPATH=/tmp/cap:$PYTHONPATH timeout 170 $W run docs/data/gpu_llama1b_2026-11-27/plan-1.yaml \
      --set train.steps=6 --json > /tmp/run-$label.json 2> /tmp/run-$label.err
  echo "== $label rc=$? $((SECONDS - t0))s" | tee -a $OUT/capped.txt
  grep -E "cap\]|OutOfMemory|Tried to allocate|Error" /tmp/run-$label.err | grep -v '^\[transformers' | tail -4 | tee -a $OUT/capped.txt
  id=$(python3 -c "import json; print(json.load(open('/tmp/run-$label.json'))['run_id'])" 2>/dev/null) || return
  $W show $id --json > /tmp/show-$label.json 2>/dev/null
  python3 - /tmp/show-$label.json <<'PY' | tee -a $OUT/capped.txt
import json, sys
d = json.load(open(sys.argv[1]))
print("status:", d.get("status"), "| error:", (d.get("error") or "")[-300:], "| step_time_s:", (d.get("summary") or {}).get("step_time_s"),
      "| peak_memory_gib:", d.get("peak_memory_gib"),
      "| cuda_alloc_conf:", (d.get("host") or {}).get("cuda_alloc_conf"), "| memory:", d.get("memory"))
PY
}
capped engine-default
capped user-old-default PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False
t0=$SECONDS
timeout 330 python3 -m pytest -q -p no:cacheprovider -rs -s tests/test_gpu.py tests/test_calibrate_gpu.py \
  tests/test_tp_and_traces.py tests/test_profilers.py > $OUT/pytest.txt 2>&1
echo "pytest rc=$? $((SECONDS - t0))s" >> $OUT/pytest.txt
tail -30 $OUT/pytest.txt
