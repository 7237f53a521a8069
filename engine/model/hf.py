"""Hugging Face causal LMs (`model.hf`) as engine models: built offline with random weights (or a
local safetensors checkpoint), laid out like engine/model/gpt.py's GPT so every parallelism applies.

`HFCausalLM` re-parents the transformers model's own modules under the GPT's names: `tok_emb`
(embed_tokens), `layers` (the decoder layers in a ModuleDict keyed by index, so a pipeline stage
deletes the others and keeps the names), `ln_f` (the final norm), `head` (lm_head), plus the
rotary embedding every stage keeps (it has no parameters). The decoder layers run unmodified;
their attention goes through one registered attention function ("workbench") that calls the
layer's `core` with the key/value heads as they are (GQA) and the layer's sliding window
(engine/parallel/context.py: `local_attention` repeats them to the query heads and masks the
window as transformers does; context parallelism's Ulysses / ring cores exchange them first).
Mixture-of-experts layers get transformers' fused expert tensors as one parameter per expert,
same weights and routing (engine/parallel/expert_fused.py, which also shards them over ep); with
`output_router_logits` the training forward leaves the router's load-balancing loss, weighted by
`router_aux_loss_coef`, in `aux_loss` for the train loop to add (transformers' `loss` includes it).
Which config field is implemented, irrelevant or refused: engine/config/hf_fields.py.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from engine.config.schema import ModelConfig
from engine.parallel.context import local_attention
from engine.model.shapes import read_hf_config

ATTENTION = "workbench"


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (b, H, t, d) q and (b, KV, t, d) k/v in,
    (b, t, H, d) out. k/v keep their KV heads into the core (context parallelism sends them so);
    `sliding_window` is the layer's (Mistral: every layer; Qwen2/3: the sliding layers only)."""
    core = getattr(module, "core", local_attention)
    out = core(query, key, value, dropout_p=dropout, doc_ids=kwargs.get("doc_ids"), window=sliding_window)
    return out.transpose(1, 2).contiguous(), None


def router_aux_loss(logits: list[torch.Tensor], *, experts: int, top_k: int, group=None) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` over every MoE layer's router logits (tokens, E),
    no padding mask: E * sum_e f_e P_e, f_e the top-k assignments to expert e per routed row and
    P_e the mean router probability, both over all layers' rows together. With `group` (the cp
    ranks holding the other chunks of the same sequences) the counts f are summed over it first,
    so the mean over those ranks of this loss is the whole sequence's, gradients included
    (transformers' function cannot take the sum, hence this copy; tests/test_hf.py checks them equal)."""
    probs = [torch.softmax(x.float(), dim=-1) for x in logits]
    chosen = torch.cat([torch.topk(p, top_k, dim=-1).indices.reshape(-1) for p in probs])
    counts = torch.bincount(chosen, minlength=experts).float()
    rows = sum(p.shape[0] for p in probs)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)  # equal chunks: rows scale by the group size
        rows_all = rows * dist.get_world_size(group)
    else:
        rows_all = rows
    mean_prob = torch.stack([p.sum(0) for p in probs]).sum(0) / rows
    return experts * torch.sum(counts / rows_all * mean_prob)


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


def hf_config(spec: str | Mapping[str, Any]):
    """transformers' config object for `model.hf` (a config.json path or folder, or a mapping)."""
    from transformers import AutoConfig

    data = read_hf_config(spec)
    kwargs = {k: v for k, v in data.items() if k not in ("model_type", "transformers_version", "architectures")}
    kwargs.pop("torch_dtype", None)
    kwargs.pop("dtype", None)
    return AutoConfig.for_model(data["model_type"], **kwargs)


class HFCausalLM(nn.Module):
    """A transformers causal LM under the engine's GPT interface (see the module docstring)."""

    has_aux_loss = True  # engine/model/moe.py's take_aux_loss collects `aux_loss` (None when dense or off)

    def __init__(self, cfg: ModelConfig, hf_model: nn.Module) -> None:
        super().__init__()
        self.cfg = cfg
        self.hf_config = hf_model.config
        base = hf_model.model
        self.tok_emb: nn.Module | None = base.embed_tokens
        self.pos_emb = None  # RoPE: no position table
        self.rotary = base.rotary_emb
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(base.layers)})
        self.ln_f: nn.Module | None = base.norm
        self.head: nn.Module | None = hf_model.lm_head
        self.tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
        self.checkpointed = False
        for layer in self.layers.values():
            layer.self_attn.core = local_attention  # context parallelism swaps in its own
        self.aux_loss_coef, self.aux_loss = router_aux_coef(self.hf_config), None
        self.router_count_group = None  # context parallelism: its cp group (router counts of whole sequences)
        self._router_logits: list[torch.Tensor] = []
        if self.aux_loss_coef:
            _record_router_logits(self, hf_model)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens (b, t) -> logits (b, t, vocab); on a middle pipeline stage, hidden -> hidden."""
        h = self.tok_emb(x) if self.tok_emb is not None else x
        if positions is None:
            positions = torch.arange(h.shape[1], device=h.device)
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(h.shape[0], -1)
        rope = self.rotary(h, position_ids=positions)
        kw: dict[str, Any] = {"position_embeddings": rope}
        if doc_ids is not None:
            kw["doc_ids"] = doc_ids
        self._router_logits.clear()  # (a recomputing backward may have recorded more)
        for layer in self.layers.values():
            if self.checkpointed and torch.is_grad_enabled():
                h = checkpoint(layer, h, use_reentrant=False, **kw)
            else:
                h = layer(h, **kw)
        if self._router_logits and self.training:
            cfg = self.hf_config
            self.aux_loss = self.aux_loss_coef * router_aux_loss(
                self._router_logits, experts=_experts(cfg), top_k=cfg.num_experts_per_tok,
                group=self.router_count_group)
        self._router_logits.clear()
        if self.ln_f is not None:
            h = self.ln_f(h)
        return self.head(h) if self.head is not None else h

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each decoder layer in backward (non-reentrant)."""
        self.checkpointed = enabled

    def tp_block_plan(self, sequence_parallel: bool) -> dict[str, object]:
        """The per-layer DTensor plan from the model's own `base_model_tp_plan` (see tp_plan)."""
        return tp_plan(self.hf_config, sequence_parallel=sequence_parallel)


def router_aux_coef(hf_cfg) -> float:
    """The weight of the router's load-balancing loss in the training loss: transformers adds
    `router_aux_loss_coef` x aux to `loss` only when `output_router_logits` is set; 0 otherwise."""
    if not getattr(hf_cfg, "output_router_logits", False) or _experts(hf_cfg) == 0:
        return 0.0
    return float(getattr(hf_cfg, "router_aux_loss_coef", 0.0) or 0.0)


def _experts(hf_cfg) -> int:
    return int(getattr(hf_cfg, "num_local_experts", None) or getattr(hf_cfg, "num_experts", None) or 0)


def _record_router_logits(owner: HFCausalLM, hf_model: nn.Module) -> None:
    """A forward hook on every router (the module class transformers itself records
    `router_logits` from, `_can_record_outputs`) appending its logits to `owner._router_logits`."""
    recorder = type(hf_model)._can_record_outputs["router_logits"]
    index = getattr(recorder, "index", 0)
    for module in owner.layers.modules():
        if isinstance(module, recorder.target_class):
            module.register_forward_hook(lambda m, args, out: owner._router_logits.append(out[index]))


def tp_plan(hf_cfg, *, sequence_parallel: bool) -> dict[str, object]:
    """`base_model_tp_plan` ("layers.*.self_attn.q_proj": "colwise", ...) as a per-layer plan of
    DTensor styles. Expert tensors stay replicated over tp (experts see every tp rank's tokens);
    per-head q/k norms ("replicated_with_grad_allreduce") get a replicated weight whose gradient
    DTensor sums over tp. With sequence parallelism the norms shard the sequence and attention /
    the MLP gather it (torchtitan's llama plan); an MoE block gathers it and scatters its output."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel, SequenceParallel)

    plan: dict[str, object] = {}
    moe = False
    for key, style in (getattr(hf_cfg, "base_model_tp_plan", None) or {}).items():
        if not key.startswith("layers.*."):
            continue
        name = key[len("layers.*."):]
        if ".experts" in f".{name}":
            moe = True
            continue
        if style == "colwise":
            plan[name] = ColwiseParallel()
        elif style == "rowwise":
            out = Shard(1) if sequence_parallel and name.endswith(("o_proj", "down_proj")) else Replicate()
            plan[name] = RowwiseParallel(output_layouts=out)
        elif style == "replicated_with_grad_allreduce":
            plan[name] = _head_sharded_norm()
    if not sequence_parallel:
        return plan
    gather = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                desired_input_kwarg_layouts={"hidden_states": Replicate()})
    plan.update({"input_layernorm": SequenceParallel(), "self_attn": gather,
                 "post_attention_layernorm": SequenceParallel(),
                 "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
    if moe:  # experts run on the full sequence, replicated; the block's output goes back to a shard
        plan["mlp"] = _gather_scatter()
    return plan


def _gather_scatter():
    """Gather the sequence-sharded input of a block part, run it replicated, scatter its output back."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    return PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                    use_local_input=True, output_layouts=(Replicate(),),
                                    desired_output_layouts=(Shard(1),), use_local_output=True)


def _head_sharded_norm():
    """A norm over the head dim of tp-sharded heads (qwen3's q_norm / k_norm): its weight becomes a
    Replicate DTensor and its input a Shard(2) DTensor over the heads, so DTensor sums the weight's
    partial gradients over tp (transformers' "replicated_with_grad_allreduce")."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class HeadShardedNorm(ParallelStyle):
        def _apply(self, module: nn.Module, mesh) -> nn.Module:
            for name, p in list(module.named_parameters(recurse=False)):
                module.register_parameter(name, nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()])))
            module.register_forward_pre_hook(
                lambda m, args: (DTensor.from_local(args[0], mesh, [Shard(2)], run_check=False),))
            module.register_forward_hook(lambda m, args, out: out.to_local())
            return module

    return HeadShardedNorm()


def build_hf_model(cfg: ModelConfig, *, seed: int, device: torch.device | str = "cpu") -> HFCausalLM:
    """The model `cfg.hf` names, fp32, identical on every rank for the same seed; the safetensors
    of `cfg.hf_weights` (a local folder) loaded when given. Never reaches the hub. On
    `device="meta"` nothing is allocated, drawn or read: engine/model/meta_init.py's `materialize` fills
    each rank's own part with these weights (the checkpoint's tensors read slice by slice)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    _register_attention()
    config = hf_config(cfg.hf)
    if torch.device(device).type == "meta":
        from engine.model.meta_init import record

        paths: dict[str, str] = {}

        def construct() -> HFCausalLM:
            hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
            before = dict(hf.named_modules())  # alive: no new module may take a replaced one's id
            hf_names = {id(m): name for name, m in before.items()}
            wrapped = _wrap(cfg, hf)
            paths.update({name: hf_names[id(m)] for name, m in wrapped.named_modules() if id(m) in hf_names})
            return wrapped

        model = record(construct, seed=seed)
        if cfg.hf_weights:  # read slice by slice at materialize; like from_pretrained, no draws
            from engine.model.hf_weights import checkpoint_reader

            model.init_record.load = (str(cfg.hf_weights), checkpoint_reader(cfg.hf_weights, model, paths))
        return model
    torch.manual_seed(seed)
    if cfg.hf_weights:
        model = AutoModelForCausalLM.from_pretrained(cfg.hf_weights, config=config, dtype=torch.float32,
                                                     local_files_only=True, attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return _wrap(cfg, model).to(device)


def _wrap(cfg: ModelConfig, model: nn.Module) -> HFCausalLM:
    """The transformers model under the engine's interface, one parameter per expert."""
    model.config._attn_implementation = ATTENTION
    from engine.parallel.expert_fused import split_fused_experts

    split_fused_experts(model)  # one parameter per expert, named by its global id (checkpoints, ep)
    return HFCausalLM(cfg, model)


def reference_model(cfg: ModelConfig, *, seed: int) -> nn.Module:
    """The unmodified transformers model with the same initial weights as `build_hf_model` (tests)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config(cfg.hf), dtype=torch.float32, attn_implementation="sdpa")
