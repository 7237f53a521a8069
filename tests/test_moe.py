"""Mixture-of-Experts: routing math, analytic counts, validation, and expert parallelism through the
real launcher matching one process (fp32, 5 steps, no token dropping, fixed routing seed)."""
from __future__ import annotations

import pytest
import torch

from engine.config.schema import ModelConfig, load_config
from engine.errors import ConfigError, ConfigErrors
from engine.model.moe import capacity, route
from engine.parallel.expert import expert_group_ranks, node_split, rank_nodes, transpose_chunks

MOE = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=16", "train.steps=5",
       "model.experts=4", "model.top_k=2", "model.capacity_factor=0", "model.aux_loss_coef=0.01",
       "train.lr=0.003", "train.warmup_steps=0", "batch.global=8", "batch.micro=2", "train.grad_clip=0.5",
       "profile.host_interval_s=0", "profile.nvml_interval_s=0", "train.eval_interval=5", "train.weight_decay=0.1"]


# ---------------------------------------------------------------- routing and counts (fast)

def test_route_top2_gates_capacity_and_aux():
    # 4 tokens, 2 experts: every token prefers expert 0
    logits = torch.tensor([[2.0, 0.0], [1.0, 0.0], [3.0, 0.0], [0.5, 0.0]])
    r = route(logits, top_k=1, capacity_factor=1.0)  # capacity ceil(1 * 4 * 1 / 2) = 2
    assert r.routed.tolist() == [4, 0]
    assert r.counts.tolist() == [2, 0]  # tokens 2 and 3 dropped (first come, first served)
    assert r.token.tolist() == [0, 1]
    p0 = torch.softmax(logits, -1)
    assert torch.allclose(r.gate, p0[:2, 0])  # Switch: top-1 gate is the router probability
    # Switch aux loss: E * sum f_e P_e with f = (1, 0)
    assert r.aux_loss.item() == pytest.approx(2 * p0[:, 0].mean().item(), rel=1e-6)
    r2 = route(logits, top_k=2, capacity_factor=0)
    assert r2.counts.tolist() == [4, 4] and r2.expert.tolist() == [0] * 4 + [1] * 4
    assert torch.allclose(r2.gate.view(2, 4).sum(0), torch.ones(4))  # GShard: renormalised top-2 gates


def test_capacity_formula():
    assert capacity(64, experts=4, top_k=2, factor=1.25) == 40
    assert capacity(64, experts=4, top_k=2, factor=0) == 128


def test_moe_parameter_and_flop_counts_match_the_module():
    from engine.model.gpt import build_model, count_parameters, flops_per_token

    cfg = ModelConfig(layers=4, d_model=32, heads=4, seq_len=16, vocab=256, experts=8, top_k=2, moe_every=2)
    counts = count_parameters(cfg)
    assert counts["total"] == sum(p.numel() for p in build_model(cfg, seed=0).parameters())
    dense = ModelConfig(layers=4, d_model=32, heads=4, seq_len=16, vocab=256)
    expert = 2 * 4 * 32 * 32
    # 2 MoE blocks: active = dense + routers + (top_k - 1) experts per MoE block
    assert counts["active"] == count_parameters(dense)["total"] + 2 * 32 * 8 + 2 * expert
    assert flops_per_token(cfg) == flops_per_token(dense) + 6 * (2 * 32 * 8 + 2 * expert)


def test_expert_groups_and_hierarchical_layout():
    from engine.mesh import ParallelDims

    ep_groups, replicas = expert_group_ranks(ParallelDims(4, 2, 1, 8).axis_groups("dp"), ep=2)
    assert ep_groups == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert replicas == [[0, 4], [2, 6], [1, 5], [3, 7]]
    # a placement order moves the ranks; the groups follow the mesh (tp pairs {0, 2}, {1, 3} here)
    holmes = ParallelDims(2, 2, 1, 4, order=(0, 2, 1, 3))
    assert holmes.axis_groups("tp") == [[0, 2], [1, 3]]
    assert expert_group_ranks(holmes.axis_groups("dp"), ep=2) == ([[0, 1], [2, 3]], [[0], [1], [2], [3]])
    assert node_split([4, 5, 6, 7], 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError):
        node_split([0, 1, 2], 2)  # 2 members on node 0, 1 on node 1
    # link.groups are the nodes when set: ep group [4, 5, 6, 7] over groups {0, 1, 4, 5}, {2, 3, 6, 7}
    by_group = rank_nodes(ranks_per_node=2, groups=[[0, 1, 4, 5], [2, 3, 6, 7]])
    assert [by_group(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert node_split([4, 5, 6, 7], by_group) == [[0, 1], [2, 3]]
    assert node_split([0, 1, 4, 5], by_group) == [[0, 1, 2, 3]]  # one node: ranks_per_node=2 would make two
    assert node_split([0, 1, 4, 5], rank_nodes(ranks_per_node=2)) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="equal, consecutive nodes"):
        node_split([0, 2, 1, 3], rank_nodes(groups=[[0, 1], [2, 3]]))  # node members not consecutive
    # chunks (a=2, b=2) with sizes [[1, 2], [3, 0]] -> b-major: a0b0, a1b0, a0b1, a1b1
    assert transpose_chunks([[1, 2], [3, 0]]).tolist() == [0, 3, 4, 5, 1, 2]


def test_lsh_sends_fewer_centroids_and_restores_tokens_exactly_through_an_identity_expert():
    from engine.comm.lsh import LSHCompressor, cross_polytope_codes

    torch.manual_seed(0)
    tokens = torch.randn(64, 16)
    expert = torch.tensor([0] * 40 + [2] * 24)
    lsh = LSHCompressor(16, buckets=8, hashes=1, seed=3)
    centroids, counts, restore = lsh.compress(tokens, expert, torch.tensor([40, 0, 24, 0]))
    assert counts[1] == 0 and counts[3] == 0 and 2 <= centroids.shape[0] <= 16  # <= 8 buckets per expert
    assert int(counts.sum()) == centroids.shape[0]
    assert torch.allclose(restore(centroids), tokens, atol=1e-6)  # E(c) + (x - c) = x for E = identity
    # cross-polytope: a code depends on direction only; opposite vectors take the opposite vertex
    proj = lsh.projections
    assert torch.equal(cross_polytope_codes(tokens, proj), cross_polytope_codes(3 * tokens, proj))
    assert torch.equal((cross_polytope_codes(-tokens, proj) - cross_polytope_codes(tokens, proj)).abs(),
                       torch.full((64,), 4))


@pytest.mark.parametrize("overrides,field", [
    (["model.experts=4", "parallel.dp=4", "parallel.ep=3"], "parallel.ep"),
    (["model.experts=4", "parallel.dp=2", "parallel.ep=4"], "parallel.ep"),
    (["parallel.dp=2", "parallel.ep=2"], "parallel.ep"),
    (["model.experts=4", "parallel.dp=2", "parallel.ep=2", "parallel.zero=1"], "parallel.ep"),
    (["model.experts=4", "parallel.dp=2", "parallel.ep=2", "comm.compressor=fp16"], "parallel.ep"),
    (["model.experts=4", "parallel.pp=2"], "model.experts"),
    (["model.experts=4", "model.top_k=5"], "model.top_k"),
    (["model.experts=4", "comm.moe_compression=lsh"], "comm.moe_compression"),
    (["model.experts=4", "parallel.dp=2", "parallel.ep=2", "comm.moe_compression=zip"], "comm.moe_compression"),
    (["model.experts=4", "parallel.dp=4", "parallel.ep=4", "comm.moe_hierarchical=true",
      "link.ranks_per_node=3"], "link.ranks_per_node"),
])
def test_validate_rejects_unsupported_moe_combinations(overrides, field):
    with pytest.raises((ConfigError, ConfigErrors)) as info:
        load_config(None, overrides)
    assert field in str(info.value)


# ---------------------------------------------------------------- expert parallelism, real ranks

EP_LAYOUTS = {
    "ep2": ["parallel.dp=2", "parallel.ep=2"],
    "ep4": ["parallel.dp=4", "parallel.ep=4"],
    "ep2-dp4": ["parallel.dp=4", "parallel.ep=2"],
    "ep2-dp2-tp2": ["parallel.dp=2", "parallel.ep=2", "parallel.tp=2"],
    # Holmes lays ranks 0, 2, 1, 3 onto the mesh: tp groups {0, 2}, {1, 3}, dp (and ep) groups {0, 1},
    # {2, 3}; before, expert groups came from a second rank formula that ignored the placement
    # (ep groups {0, 2}, {1, 3}: the tp pairs) and step 0's loss was already off
    "ep2-dp2-tp2-holmes": ["parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "parallel.placement=holmes",
                           "link.groups=[{name: a, ranks: [0, 2], gbps: 100}, {name: b, ranks: [1, 3], gbps: 100}]",
                           "link.inter_gbps=100"],
    # two emulated nodes of 2 ranks: inside-node all_to_all, then across nodes; exact, so parity holds
    "ep4-hierarchical": ["parallel.dp=4", "parallel.ep=4", "comm.moe_hierarchical=true", "link.ranks_per_node=2"],
}


@pytest.fixture(scope="module")
def moe_reference():
    from parallel_harness import trainer_reference

    return trainer_reference(MOE)


@pytest.mark.xdist_group("moe")  # its own worker: the "launch" group is the suite's long pole
@pytest.mark.parametrize("name", list(EP_LAYOUTS))
def test_expert_parallel_matches_single_process(tmp_path, moe_reference, name):
    from engine.launch.local import launch
    from parallel_harness import assert_launch_follows

    result = launch(load_config(None, MOE + EP_LAYOUTS[name]), home=tmp_path)
    assert_launch_follows(result, *moe_reference, steps=5)


@pytest.mark.xdist_group("moe")  # its own worker: the "launch" group is the suite's long pole
def test_show_json_has_all_to_all_records_and_expert_load(tmp_path):
    """`workbench show --json` of a real ep=2 run (with LSH compression and token dropping)."""
    import json
    import os
    import subprocess
    import sys

    from engine.launch.local import launch

    cfg = load_config(None, MOE + ["parallel.dp=2", "parallel.ep=2", "train.steps=2", "model.capacity_factor=1.0",
                                   "comm.moe_compression=lsh", "train.eval_interval=0"])
    result = launch(cfg, home=tmp_path)
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "show", result.run_id, "--json"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "WORKBENCH_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    a2a = report["collectives"]["ep:all_to_all"]
    assert a2a["bytes"] > 0 and a2a["busbw(GB/s)"] > 0 and a2a["ranks"] == 2
    # per layer and micro-batch: counts, dispatch, combine forward; dispatch, combine backward
    assert a2a["count"] == 2 * 2 * 2 * 5  # steps x micro-batches x MoE layers x 5
    moe = report["moe"]["per_step"]
    assert {(r["step"], r["rank"]) for r in moe} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for row in moe:
        # 2 micro-batches x 2 samples x 16 tokens x top-2 x 2 MoE layers routed by each rank per step
        assert len(row["tokens_per_expert"]) == 4 and sum(row["tokens_per_expert"]) == 2 * 2 * 16 * 2 * 2
        assert 0.0 <= row["drop_rate"] < 1.0


def test_moe_example_and_its_search_space_are_valid():
    from engine.config.schema import replace
    from tuning.space import SearchSpace

    base = load_config("examples/moe.yaml")
    assert base.model.experts == 4 and base.parallel.ep == 2 and base.world_size == 2
    space = SearchSpace.from_yaml("examples/moe_space.yaml")
    space.check_against(base)
    points = space.grid()
    assert {p["parallel.ep"] for p in points} == {1, 2}
    assert {p.get("comm.moe_compression") for p in points} == {None, "none", "lsh"}
    for point in points:  # every point of the space is a valid run of the example
        replace(base, space.to_overrides(point, base))


def test_moe_report_figures_and_text():
    """The Run page's MoE figures and `show`'s MoE table from a report's `moe` section."""
    import io

    from rich.console import Console

    from workbench import live_charts
    from workbench.report import print_report

    per_step = [{"step": s, "rank": r, "tokens_per_expert": [10.0 * (r + 1), 5.0, 0.0, 1.0], "drop_rate": 0.25 * r,
                 "imbalance": 2.0} for s in range(2) for r in range(2)]
    load = live_charts.moe_load(per_step)
    assert list(load.data["rank"].unique()) == ["rank 0", "rank 1"]
    assert list(load.data[load.data["rank"] == "rank 1"]["tokens"]) == [40.0, 10.0, 0.0, 2.0]  # summed over 2 steps
    drops = live_charts.moe_drops(per_step)
    assert list(drops.data[drops.data["rank"] == "rank 1"]["dropped"]) == [0.25, 0.25]
    for chart in (load, drops):  # the dashboard's rule: a title and a unit on the y axis
        assert chart.title and "(" in chart.spec["encoding"]["y"]["title"]
    report = {"run_id": "r", "status": "done", "world_size": 2, "layout": {}, "emulated": False, "error": None,
              "summary": {}, "breakdown": [], "collectives": {}, "memory": {}, "moe": {"per_step": per_step}}
    out = io.StringIO()
    print_report(report, Console(file=out, width=120))
    assert "MoE tokens routed per expert" in out.getvalue() and "25.0%" in out.getvalue()


def _exchange_vs_local(rank: int, world: int, hierarchical: bool) -> float:
    """Every token of both ranks goes to expert 0 (rank 0's): rank 1's experts get no rows, rank 1
    sends everything; the exchanged outputs must equal the experts applied locally."""
    from engine.model.moe import MoE
    from engine.parallel.expert import apply_expert_parallel

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=8, experts=4, top_k=1, capacity_factor=0)
    ref = MoE(cfg)
    layer = MoE(cfg)
    layer.load_state_dict(ref.state_dict())
    model = torch.nn.ModuleDict({"moe": layer})
    from engine.mesh import ParallelDims

    mesh = ParallelDims(2, 1, 1, 2).build_mesh("cpu")
    apply_expert_parallel(model, mesh, ep=2, hierarchical=hierarchical, ranks_per_node=1)
    tokens = torch.randn(5 + rank, 8, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    counts = torch.tensor([5 + rank, 0, 0, 0])
    got = layer.exchange(tokens, counts)
    got.sum().backward()
    want = ref.run_experts(tokens.detach(), counts)
    return float((got - want).abs().max()) + float((tokens.grad - torch.autograd.grad(
        ref.run_experts(tokens, counts).sum(), tokens)[0]).abs().max())


@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "hierarchical"])
def test_exchange_with_empty_splits_equals_local_experts(hierarchical):
    from parallel_harness import run_ranks

    # rank 1 holds experts 2, 3 and receives nothing; before the fix: IndexError on its empty buffer
    assert max(run_ranks(2, _exchange_vs_local, hierarchical, timeout=120)) < 1e-6


@pytest.mark.parametrize("ep,tp", [(1, 1), (2, 1), (4, 1), (1, 2)])
def test_memory_estimate_counts_this_ranks_experts(ep, tp):
    from engine.train.memory import estimate_memory
    from engine.model.gpt import build_model

    cfg = load_config(None, MOE + ["model.experts=8", "model.moe_every=2", "model.layers=4",
                                   f"parallel.dp={ep}", f"parallel.ep={ep}", f"parallel.tp={tp}"])
    model = build_model(cfg.model, seed=0)
    held = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            held += p.numel() / ep  # apply_expert_parallel keeps experts/ep of each MoE layer
        elif "layers." in name and p.dim() == 2 and "router" not in name:
            held += p.numel() / tp  # attention (and dense MLP) matmuls split over tp
        else:
            held += p.numel()
    params = estimate_memory(cfg)["params"] / 4
    assert params == pytest.approx(held, rel=1e-9)


def _checkpoint_record(path) -> tuple[dict, dict[str, int]]:
    """The layout record of a DCP checkpoint folder and, per tensor name, how many copies it stores."""
    import json
    import warnings
    from collections import Counter

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    meta = {"meta": torch.empty(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata["meta"].size,
                                dtype=torch.uint8)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(meta, storage_reader=FileSystemReader(str(path)))
    copies = Counter(index.fqn for index in FileSystemReader(str(path)).read_metadata().storage_data)
    return json.loads(bytes(meta["meta"].tolist()).decode()), dict(copies)


EP_RESUMES = {  # (saved in, resumed in)
    "ep2-to-ep2": (["parallel.dp=2", "parallel.ep=2"], ["parallel.dp=2", "parallel.ep=2"]),
    "ep2-to-ep1": (["parallel.dp=2", "parallel.ep=2"], []),
    # two replicas of each ep shard (ranks 0, 2 and 1, 3): each expert stored once
    "dp4-ep2-to-dp2": (["parallel.dp=4", "parallel.ep=2"], ["parallel.dp=2"]),
}


@pytest.mark.xdist_group("moe")  # its own worker: the "launch" group is the suite's long pole
@pytest.mark.parametrize("name", list(EP_RESUMES))
def test_expert_parallel_checkpoint_resumes_in_ep2_and_ep1(tmp_path, tmp_path_factory, name):
    """An ep=2 checkpoint names each expert by its global id and records ep: the same layout and
    ep=1 continue the uninterrupted run (before: each ep rank saved its experts as `experts.0`,
    `experts.1` and DCP kept one rank's copy; ep=1 failed on "Missing key ... experts.2"). One saved run per
    saved layout (tests/saved_runs.py)."""
    from engine.launch.local import launch
    from saved_runs import saved_run

    saved_in, resumed_in = EP_RESUMES[name]
    common = MOE + ["train.steps=6", "train.eval_interval=0"]
    full, ckpt = saved_run(common + saved_in, tmp_path_factory)
    record, copies = _checkpoint_record(ckpt / "step000003")
    assert (record["ep"], record["cp"], record["dp"]) == (2, 1, int(saved_in[0].split("=")[1]))
    experts = {k for k in copies if k.startswith("model.") and ".experts." in k}
    # 2 MoE layers x 4 experts x (w1, w2) weights, each stored once under its global id
    assert {k.split(".experts.")[1].split(".")[0] for k in experts} == {"0", "1", "2", "3"}
    assert len(experts) == 2 * 4 * 2 and all(copies[k] == 1 for k in experts), copies
    resumed = launch(load_config(None, common + resumed_in + [f"train.resume_from={ckpt / 'step000003'}"]),
                     home=tmp_path)
    assert [s["step"] for s in resumed.steps] == [3, 4, 5]
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(resumed.steps, full.steps[3:]))
    assert diff <= 1e-6, (resumed.steps, full.steps[3:])


def test_moe_forward_under_bf16_autocast_sums_in_the_residual_dtype():
    """precision=bf16: the experts' outputs are bf16 under autocast, the residual stream fp32; the
    weighted sum goes into an fp32 buffer and matches the fp32 layer within bf16 rounding."""
    from engine.model.moe import MoE

    torch.manual_seed(0)
    layer = MoE(ModelConfig(d_model=8, experts=4, top_k=2, capacity_factor=0))
    x = torch.randn(2, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x)
    assert got.dtype == torch.float32
    assert float((got - layer(x)).abs().max()) < 5e-2
