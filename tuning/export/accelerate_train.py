"""Train a Hugging Face causal LM with accelerate: the script `workbench export --format accelerate -o DIR/x.yaml`
writes beside the accelerate config, with the run's settings in SETTINGS at the top.

    accelerate launch --config_file x.yaml x_train.py

It trains what the workbench run trains, step for step: the model of `model_hf` (a config.json, random
weights from `seed`, or the safetensors of `hf_weights`), the documents of `data` read in order (rows of
seq_len + 1 tokens, each process taking its rows of every global batch), `micro` rows per forward and
`accum` forwards per optimizer step, AdamW (decay on matrices only), the lr schedule (linear warm-up,
then cosine / linear decay or constant), gradient clipping; one JSON line per step with the global
batch's mean loss. It needs torch, transformers, accelerate and numpy; `datasets` and `tokenizers` for
a jsonl source; megatron-core for a Megatron dataset; the workbench itself only for its own
stand-in data (data.source text, files or synthetic).
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

SETTINGS: dict = {}  # the export fills this in


def lr_at(step: int, s: dict) -> float:
    """Linear warm-up, then cosine / linear decay to lr * min_lr_ratio, or constant."""
    if step < s["warmup_steps"]:
        return s["lr"] * (step + 1) / s["warmup_steps"]
    if s["schedule"] == "constant" or s["steps"] <= s["warmup_steps"]:
        return s["lr"]
    frac = min(1.0, (step - s["warmup_steps"]) / max(1, s["steps"] - s["warmup_steps"]))
    decay = 0.5 * (1 + math.cos(math.pi * frac)) if s["schedule"] == "cosine" else 1 - frac
    return s["lr"] * (s["min_lr_ratio"] + (1 - s["min_lr_ratio"]) * decay)


def build_model(s: dict) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = s["model_hf"]
    data = json.loads(Path(spec).read_text()) if isinstance(spec, str) else dict(spec)
    kwargs = {k: v for k, v in data.items()
              if k not in ("model_type", "transformers_version", "architectures", "torch_dtype", "dtype")}
    config = AutoConfig.for_model(data["model_type"], **kwargs)
    torch.manual_seed(s["seed"])
    if s.get("hf_weights"):
        return AutoModelForCausalLM.from_pretrained(s["hf_weights"], config=config, dtype=torch.float32,
                                                    local_files_only=True, attn_implementation="sdpa")
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def _train_docs(n: int, val_fraction: float) -> int:
    """Documents in the train split: all but the last val_fraction, at least one on each side."""
    return min(n - 1, max(1, n - max(1, round(n * val_fraction))))


def train_tokens(s: dict) -> np.ndarray:
    """The train split's documents as one array of ids, read in order."""
    d = s["data"]
    if d["source"] == "tokens":
        ids = np.memmap(d["path"], dtype={"uint16": np.uint16, "uint32": np.uint32}[d["dtype"]], mode="r")
        return ids[:len(ids) - max(int(len(ids) * d["val_fraction"]), s["seq_len"] + 2)]
    if d["source"] == "megatron":
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        ds = IndexedDataset(d["path"].removesuffix(".bin").removesuffix(".idx"), mmap=True)
        return np.concatenate([np.asarray(ds[i], dtype=np.int64) for i in range(_train_docs(len(ds),
                                                                                           d["val_fraction"]))])
    return _hf_tokens(d)


def _hf_tokens(d: dict) -> np.ndarray:
    import datasets
    from tokenizers import Tokenizer

    path, tok_path = Path(d["path"]), Path(d["tokenizer"])
    tok_path = tok_path / "tokenizer.json" if tok_path.is_dir() else tok_path
    tok = Tokenizer.from_file(str(tok_path))
    suffix = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".arrow": "arrow"}
    files = sorted(str(f) for f in path.rglob("*") if f.suffix in suffix) if path.is_dir() else [str(path)]
    kind = suffix[Path(files[0]).suffix]
    ds = datasets.concatenate_datasets([datasets.Dataset.from_file(f) for f in files]) if kind == "arrow" else \
        datasets.load_dataset(kind, data_files=files, split="train")
    tail = [d["eos_id"]] if d["eos_id"] >= 0 else []
    docs = [tok.encode(ds[i][d["text_field"]]).ids + tail for i in range(_train_docs(len(ds), d["val_fraction"]))]
    return np.asarray([t for doc in docs for t in doc], dtype=np.int64)


def batches(s: dict, rank: int, world: int):
    """This process's rows (x, y) of each step's global batch."""
    rows, seq, per = s["global_batch"], s["seq_len"], s["global_batch"] // world
    if s["data"]["source"] in ("tokens", "megatron", "hf"):
        ids = train_tokens(s)
        for step in range(s["steps"]):  # the next rows * seq + 1 tokens, from where the last batch ended
            at = (step * rows * seq + np.arange(rows)[:, None] * seq + np.arange(seq + 1)[None, :]) % len(ids)
            chunk = torch.from_numpy(np.asarray(ids[at], dtype=np.int64))[rank * per:(rank + 1) * per]
            yield chunk[:, :-1], chunk[:, 1:]
        return
    from engine.config.schema import from_dict  # the workbench's own stand-in data (text, files, synthetic)
    from engine.data.corpus import build_splits, local_batch

    cfg = from_dict({"data": s["data"], "model": {"seq_len": seq, "vocab": s["vocab"]}})
    train = build_splits(cfg.data, cfg.model, seed=s["seed"]).train
    for step in range(s["steps"]):
        yield local_batch(train, global_batch=rows, dp=world, dp_rank=rank, seed=s["seed"], step=step)


def main() -> None:
    from accelerate import Accelerator

    s = SETTINGS
    # accelerate's MULTI_CPU needs cpu=True in the script: without a GPU its processes train on the CPU (gloo)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=s["accum"],
                              step_scheduler_with_optimizer=False)
    model = build_model(s)
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": s["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=s["lr"], betas=(s["beta1"], s["beta2"]), fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, s) / s["lr"])
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    for step, (x, y) in enumerate(batches(s, accelerator.process_index, accelerator.num_processes)):
        x, y = x.to(accelerator.device), y.to(accelerator.device)
        total = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        for i in range(s["accum"]):
            with accelerator.accumulate(model), accelerator.autocast():
                rows = slice(i * s["micro"], (i + 1) * s["micro"])
                logits = model(input_ids=x[rows]).logits
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y[rows].reshape(-1))
                total += loss.detach().double() / s["accum"]
                accelerator.backward(loss)  # divided by the accumulation steps
                if accelerator.sync_gradients and s["grad_clip"] > 0:
                    accelerator.clip_grad_norm_(model.parameters(), s["grad_clip"])
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        mean = accelerator.reduce(total, reduction="mean").item()
        if accelerator.is_main_process:
            print(json.dumps({"step": step, "loss": mean, "lr": lr_at(step, s)}), flush=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    if os.environ.get("WORKBENCH_SETTINGS"):  # a settings file instead of the embedded ones
        SETTINGS.update(json.loads(Path(os.environ["WORKBENCH_SETTINGS"]).read_text()))
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # gloo: a process sometimes aborts in its exit-time teardown after correct work ("terminate called without
    # an active exception", exit -6); barrier, destroy, then leave without the interpreter's teardown
    os._exit(0)
