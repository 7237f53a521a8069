"""What building a model costs each rank's memory: meta construction (engine/model/meta_init.py) against
the whole-model CPU build e19d228 did (the baseline), per layout, on 2 real gloo ranks.

Each row: a model and layout, built and laid out through engine.train.compose (no training step); per
rank the RSS growth from before the build, its peak (VmHWM), and the bytes of the parameters the
rank holds, as multiples of the model's fp32 bytes; seconds to build. The rank body is the test's
(tests/test_meta_init.py::_memory_after_layout). The legacy build of the 1B model needs 5-10 GB per
rank: only with --legacy-1b.

    python bench/meta_init_memory.py [--legacy-1b]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the test's rank body, measured here

GPT = ["model.layers=24", "model.d_model=1024", "model.heads=16", "model.vocab=50304", "model.seq_len=128"]
MOE = ["model.layers=8", "model.d_model=768", "model.heads=12", "model.vocab=50304", "model.seq_len=128",
       "model.experts=8", "model.top_k=2"]
COMMON = ["batch.global=2", "batch.micro=1", "train.steps=1", "profile.host_interval_s=0", "profile.nvml_interval_s=0"]
LAYOUTS = {"zero3-dp2": ["parallel.dp=2", "parallel.zero=3"], "pp2": ["parallel.pp=2"], "tp2": ["parallel.tp=2"],
           "ep2": ["parallel.dp=2", "parallel.ep=2"]}


def rows(llama_dir: str, legacy_1b: bool) -> list[tuple[str, list[str], list[str], bool]]:
    llama = [f"model.hf={llama_dir}", "model.seq_len=128"]
    out = [("llama-3.2-1b", llama, LAYOUTS[k], False) for k in ("zero3-dp2", "pp2")]
    out += [("llama-3.2-1b", llama, LAYOUTS[k], True) for k in ("zero3-dp2", "pp2") if legacy_1b]
    for legacy in (False, True):
        out += [("gpt-350m", GPT, LAYOUTS[k], legacy) for k in ("zero3-dp2", "pp2", "tp2")]
        out += [("moe-8x", MOE, LAYOUTS[k], legacy) for k in ("zero3-dp2", "ep2")]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--legacy-1b", action="store_true")
    args = ap.parse_args()
    from parallel_harness import run_ranks
    from test_meta_init import LLAMA_3_2_1B, _memory_after_layout

    from engine.config.schema import load_config
    from engine.model.gpt import count_parameters

    print(f"host: {os.cpu_count()} cpus, load1 {os.getloadavg()[0]:.1f}; 2 gloo ranks, one thread each")
    print(f"{'model':14s} {'layout':10s} {'build':7s} {'GiB':>5s} {'rank':>4s} {'RSS +':>7s} {'peak +':>7s} "
          f"{'holds':>6s} {'s':>5s}")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(LLAMA_3_2_1B))
        for name, model, layout, legacy in rows(tmp, args.legacy_1b):
            overrides = [*model, *COMMON, *layout]
            full = 4 * count_parameters(load_config(None, overrides).model)["total"]
            results = run_ranks(2, _memory_after_layout, overrides, legacy, timeout=1800)
            for rank, r in enumerate(results):
                print(f"{name:14s} {'/'.join(x.split('=')[0][9:] + x.split('=')[1] for x in layout):10s} "
                      f"{'cpu' if legacy else 'meta':7s} {full / 2**30:5.2f} {rank:4d} {r['grew'] / full:6.3f}x "
                      f"{r['peak'] / full:6.3f}x {r['held'] / full:5.3f}x {r['seconds']:5.0f}", flush=True)


if __name__ == "__main__":
    main()
