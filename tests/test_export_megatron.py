"""The Megatron-LM export builds the same model, judged by megatron-core: the exported flags are parsed the way
Megatron-LM core_v0.16.1 makes them (its ArgumentGroupFactory turns each field of megatron-core's
TransformerConfig into a flag; the network-size, tokenizer and MoE flags it adds by hand are declared as its
arguments.py does), mapped as its `core_transformer_config_from_args` and `gpt_builder` map them, and
megatron-core's `GPTModel` built from them on the meta device has transformers' parameter count.
(PyPI's megatron-core has no `megatron.training`: this is the smallest version of its flags -> model path.)"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import shlex
import typing
from pathlib import Path

import pytest
import torch

from engine.config.schema import apply_overrides, from_dict
from tuning.export.trial import megatron_args, megatron_script

REPO = Path(__file__).resolve().parent.parent
LLAMA31_8B = REPO / "examples" / "llama3_8b" / "config.json"
QWEN3_06B = {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
             "tie_word_embeddings": True, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
             "max_position_embeddings": 40960, "attention_bias": False}
MIXTRAL_8X7B = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                "num_experts_per_tok": 2, "vocab_size": 32000, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
                "max_position_embeddings": 32768, "tie_word_embeddings": False, "router_aux_loss_coef": 0.02}
QWEN2_05B = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
             "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768}
# what Megatron-LM's parser holds besides the model: the launch's layout, batch, schedule and data flags
TRAINING_FLAGS = {"--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size",
                  "--global-batch-size", "--attention-dropout", "--hidden-dropout", "--train-iters", "--lr",
                  "--min-lr", "--lr-warmup-iters", "--lr-decay-style", "--weight-decay", "--adam-beta1", "--adam-beta2",
                  "--clip-grad", "--seed", "--bf16", "--use-distributed-optimizer", "--tokenizer-type",
                  "--tokenizer-model", "--data-path", "--split", "--mock-data", "--sequence-parallel",
                  "--context-parallel-size", "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
                  "--seq-length", "--eval-interval", "--num-layers-per-virtual-pipeline-stage",
                  # what a plan's knobs add (tuning/export/megatron.py knob_flags): AttnBackend's and the DDP flags
                  "--attention-backend", "--overlap-grad-reduce", "--overlap-param-gather"}


def _transformer_config_parser(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM core_v0.16.1's ArgumentGroupFactory over megatron-core's TransformerConfig: `--field-name`
    (argparse_meta's arg_names where given), bools store_true, or store_false as --no-/--disable- when True."""
    from megatron.core.transformer import TransformerConfig

    handled = {"moe_aux_loss_coeff", "moe_layer_freq", "num_moe_experts", "window_size",
               "window_attn_skip_freq"}  # arguments.py declares these itself
    for f in dataclasses.fields(TransformerConfig):
        meta = dict(f.metadata.get("argparse_meta", {}))
        kind = typing.get_args(f.type)[0] if typing.get_origin(f.type) is typing.Union else f.type
        if f.name in handled or not f.init or kind not in (bool, int, float, str) and typing.get_origin(kind) \
                is not typing.Literal:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        names = [f"--{f.name.replace('_', '-')}"]
        kwargs: dict = {"dest": f.name, "default": default}
        if kind is bool:
            kwargs["action"] = "store_true" if not default else "store_false"
            if default:
                names = [f"--no-{f.name.replace('_', '-')}", f"--disable-{f.name.replace('_', '-')}"]
        else:
            kwargs["type"] = type(typing.get_args(kind)[0]) if typing.get_origin(kind) is typing.Literal else kind
        names = meta.pop("arg_names", names)
        kwargs.update(meta)
        parser.add_argument(*names, **kwargs)


def megatron_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    _transformer_config_parser(parser)
    # Megatron-LM core_v0.16.1 arguments.py: network size, tokenizer, MoE (the flags it declares by hand)
    for flag in ("--group-query-attention", "--swiglu", "--use-rope-scaling", "--untie-embeddings-and-output-weights"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--max-position-embeddings", type=int, default=None)
    parser.add_argument("--position-embedding-type", default="learned_absolute",
                        choices=["learned_absolute", "rope", "mrope", "relative", "none"])
    parser.add_argument("--rotary-base", type=int, default=10000)
    parser.add_argument("--rotary-percent", type=float, default=1.0)
    parser.add_argument("--rope-scaling-factor", type=float, default=8.0)
    parser.add_argument("--padded-vocab-size", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    parser.add_argument("--num-experts", type=int, default=None)
    parser.add_argument("--moe-layer-freq", type=lambda s: ast.literal_eval(s) if "[" in s else int(s), default=1)
    parser.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0)
    # its tuple_type ("4095,0" -> (4095, 0)) and moe_freq_type (an int, or a list's Python expression)
    parser.add_argument("--window-size", type=lambda s: tuple(int(i) for i in s.strip("()").split(",")), default=None)
    parser.add_argument("--window-attn-skip-freq", type=lambda s: ast.literal_eval(s) if "[" in s else int(s),
                        default=None)
    return parser


def build_gpt_model(args: list[str]):
    """megatron-core's GPTModel from the exported flags on the meta device, as gpt_builder builds it."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    ns, unknown = megatron_parser().parse_known_args(args)
    flags = {a for a in unknown if a.startswith("--")}
    assert flags <= TRAINING_FLAGS, f"flags no parser of Megatron-LM knows: {flags - TRAINING_FLAGS}"
    # core_transformer_config_from_args: the fields by name, then its by-hand mappings
    kw = {f.name: getattr(ns, f.name) for f in dataclasses.fields(TransformerConfig) if hasattr(ns, f.name)}
    coeff = ns.moe_aux_loss_coeff
    kw.update(num_moe_experts=ns.num_experts, moe_layer_freq=ns.moe_layer_freq,
              moe_aux_loss_coeff=coeff[0] if isinstance(coeff, list) and len(coeff) == 1 else coeff,
              num_query_groups=ns.num_query_groups if ns.group_query_attention else None,
              use_cpu_initialization=True, init_model_with_meta_device=True)
    dtype = torch.bfloat16 if ns.bf16 else torch.float32  # validate_args' params_dtype, the pipeline's dtype
    kw.update(params_dtype=dtype, pipeline_dtype=dtype)
    if ns.swiglu:
        kw.update(activation_func=F.silu, gated_linear_unit=True, bias_activation_fusion=False)
    # grouped GEMM experts need Transformer Engine or grouped_gemm (GPU packages) and hold SequentialMLP's parameters
    kw["moe_grouped_gemm"] = False
    config = TransformerConfig(**kw)
    if ns.num_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=ns.normalization)
    else:
        spec = get_gpt_layer_local_spec(config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm,
                                        normalization=config.normalization)
    vocab = ns.padded_vocab_size
    if vocab is None:  # build_tokenizer: a null tokenizer's ids and its end-of-document id, padded to 128 * tp
        multiple = ns.make_vocab_size_divisible_by * ns.tensor_model_parallel_size
        vocab = -(-(ns.vocab_size + 1) // multiple) * multiple
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:  # all-to-all dispatch opens a CUDA stream when built
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()  # (no parameters): a placeholder on this CPU machine
    with torch.device("meta"):
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab,
                        max_sequence_length=ns.max_position_embeddings,
                        share_embeddings_and_output_weights=not ns.untie_embeddings_and_output_weights,
                        position_embedding_type=ns.position_embedding_type, rotary_percent=ns.rotary_percent,
                        rotary_base=ns.rotary_base, rope_scaling=ns.use_rope_scaling), ns


def transformers_params(config: dict | Path) -> int:
    from engine.model.hf import hf_config
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(config if isinstance(config, dict) else str(config)))
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def model_parallel(tmp_path_factory):
    """megatron-core's parallel state over a 1-rank gloo group (what its modules ask at construction)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'store'}", rank=0,
                            world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def unvalidated(overrides: list[str]):
    """A run config of a real-size model: exported, priced, never trained here (no validate())."""
    return from_dict(apply_overrides({}, overrides))


def _config(tmp_path: Path, hf: dict | Path, *extra: str):
    if isinstance(hf, dict):
        path = tmp_path / "config.json"
        path.write_text(json.dumps(hf))
        hf = path
    return unvalidated([f"model.hf={hf}", "model.seq_len=4096", "batch.global=64", "batch.micro=1", "parallel.dp=8",
                        "parallel.tp=8", "precision=bf16", *extra])


@pytest.mark.parametrize("name,hf", [("llama-3.1-8b", LLAMA31_8B), ("qwen3-0.6b", QWEN3_06B),
                                     ("mixtral-8x7b", MIXTRAL_8X7B), ("qwen2-0.5b", QWEN2_05B)])
def test_megatron_core_builds_the_parameters_transformers_builds(model_parallel, tmp_path, name, hf):
    extra = {"mixtral-8x7b": ["parallel.ep=8"], "qwen2-0.5b": ["parallel.tp=2", "parallel.dp=32"]}.get(name, [])
    cfg = _config(tmp_path, hf, *extra)
    args, notes = megatron_args(cfg)
    model, ns = build_gpt_model(args)
    built = sum(p.numel() for p in model.parameters())
    assert built == transformers_params(hf)
    if name == "llama-3.1-8b":
        assert built == 8_030_261_248
        assert (ns.rotary_base, ns.use_rope_scaling, ns.rope_scaling_factor) == (500000, True, 8.0)
        assert not any(n.startswith("rope_scaling") for n in notes)
    if name == "mixtral-8x7b":
        assert (ns.num_experts, ns.moe_router_topk, ns.expert_model_parallel_size) == (8, 2, 8)
        assert ns.moe_aux_loss_coeff == [0.02]
    if name == "qwen3-0.6b":
        assert ns.qk_layernorm and ns.kv_channels == 128 and not ns.untie_embeddings_and_output_weights
    if name == "qwen2-0.5b":
        assert ns.add_qkv_bias and not ns.add_bias_linear


def test_megatron_script_carries_tokenizer_data_schedule_and_names_the_rest(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "config.json").write_text(LLAMA31_8B.read_text())
    cfg = unvalidated([f"model.hf={tmp_path / 'config.json'}", "model.seq_len=8192", "batch.global=512",
                       "batch.micro=1", "parallel.dp=8", "parallel.tp=8", "data.source=hf",
                       f"data.path={tmp_path / 'corpus.jsonl'}", f"data.tokenizer={tmp_path}", "train.steps=1000",
                       "train.warmup_steps=100", "model.hf_weights=/weights", "cluster.nodes=8"])
    text = megatron_script(cfg)
    tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    at = {t: tokens[i + 1] for i, t in enumerate(tokens[:-1]) if t.startswith("--")}
    assert at["--tokenizer-type"] == "HuggingFaceTokenizer" and at["--tokenizer-model"] == str(tmp_path)
    assert at["--data-path"] == f"{tmp_path / 'corpus'}_megatron_text_document"
    assert "tools/preprocess_data.py --input" in text and "--append-eod" in text
    assert (at["--train-iters"], at["--lr-warmup-iters"], at["--lr-decay-style"]) == ("1000", "100", "cosine")
    assert "--nproc-per-node=8" in tokens and "--nnodes=8" in tokens
    notes = [line[len("# not mapped: "):] for line in text.splitlines() if line.startswith("# not mapped: ")]
    assert any(n.startswith("model.hf_weights=/weights: Megatron-LM loads its own checkpoints") for n in notes)
    assert any(n.startswith("lr warm-up: Megatron-LM starts at 0") for n in notes)
    llama32 = json.loads(LLAMA31_8B.read_text()) | {"rope_scaling": {"rope_type": "llama3", "factor": 32.0,
                                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                      "original_max_position_embeddings": 8192}}
    notes = megatron_args(_config(tmp_path, llama32))[1]
    assert any(n.startswith("rope_scaling factor=32: Megatron-LM's gpt_builder") for n in notes)
