"""Reshard of Qwen3-MoE weights (issue 38 item 3), single process: every rank of a layout played
by ``run_plan_local``, from megatron training shards at (tp, ep, expert tp) cut by this file's
own oracle out of seeded full HF tensors (the per-expert names checkpoints hold on disk), into
the engine format at gen tp. Checks: every gen rank's tensors are bit-identical to the oracle's
engine shards; no rank receives a row it holds or a row twice (bytes received = its gen shard
minus what it holds); the plan's expert specs and names; the HF export round trip; bad splits
are one ValueError.

The distributed test (tests/distributed/test_moe_reshard.py) imports the oracle helpers.
"""

from __future__ import annotations

import pytest
import torch

from hybridrl.reshard.specs import LlamaShape, build_specs
from tests.unit.test_reshard_oracle import engine_shards, make_hf, megatron_shards

MOE = LlamaShape(hidden=16, ffn=24, heads=8, num_query_groups=4, layers=2, vocab=60, head_dim=4,
                 make_vocab_size_divisible_by=8, qk_norm=True, num_experts=8, moe_topk=2,
                 moe_ffn_hidden_size=12)


def make_moe_hf(shape: LlamaShape, seed: int = 0, dtype=torch.float32) -> dict:
    """Seeded full HF Qwen3-MoE tensors: the dense oracle's attention, norms and vocabulary,
    q/k norms, and per layer ``mlp.gate.weight`` and ``mlp.experts.e.{gate,up,down}_proj``."""
    hf = make_hf(shape, seed, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    H, F, E = shape.hidden, shape.moe_ffn_hidden_size, shape.num_experts
    for L in range(shape.layers):
        p = f"model.layers.{L}."
        for name in ("gate_proj", "up_proj", "down_proj"):
            del hf[f"{p}mlp.{name}.weight"]
        for name in ("q_norm", "k_norm"):
            hf[f"{p}self_attn.{name}.weight"] = torch.randn(shape.head_dim, generator=g).to(dtype)
        hf[p + "mlp.gate.weight"] = torch.randn(E, H, generator=g).to(dtype)
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            hf[q + "gate_proj.weight"] = torch.randn(F, H, generator=g).to(dtype)
            hf[q + "up_proj.weight"] = torch.randn(F, H, generator=g).to(dtype)
            hf[q + "down_proj.weight"] = torch.randn(H, F, generator=g).to(dtype)
    return hf


def _dense_view(shape: LlamaShape, hf: dict) -> dict:
    """``hf`` with zero dense-MLP placeholders, so the dense oracles cut everything else."""
    out = dict(hf)
    for L in range(shape.layers):
        p = f"model.layers.{L}.mlp."
        out[p + "gate_proj.weight"] = torch.zeros(shape.ffn, shape.hidden)
        out[p + "up_proj.weight"] = torch.zeros(shape.ffn, shape.hidden)
        out[p + "down_proj.weight"] = torch.zeros(shape.hidden, shape.ffn)
    return out


def moe_megatron_shards(shape, hf, tp, b, chunk, ep, er, etp, eb) -> dict:
    """megatron-core tensors (pp = 1) of a rank at TP rank b of tp, EP rank er of ep, expert TP
    rank eb of etp: SequentialMLP's local_experts.j = global expert er·E/ep + j, [gate; up]
    rows and down columns of the rank's expert-TP slice; the router whole."""
    out = megatron_shards(shape, _dense_view(shape, hf), tp, b, 1, 0, chunk)
    E, f = shape.num_experts, shape.moe_ffn_hidden_size // etp
    for L in range(shape.layers):
        m, h = f"decoder.layers.{L}.", f"model.layers.{L}."
        del out[m + "mlp.linear_fc1.weight"], out[m + "mlp.linear_fc2.weight"]
        for n, hn in (("q", "q_norm"), ("k", "k_norm")):
            out[f"{m}self_attention.{n}_layernorm.weight"] = hf[f"{h}self_attn.{hn}.weight"].clone()
        out[m + "mlp.router.weight"] = hf[h + "mlp.gate.weight"].clone()
        for j in range(E // ep):
            x, q = f"{h}mlp.experts.{er * E // ep + j}.", f"{m}mlp.experts.local_experts.{j}."
            out[q + "linear_fc1.weight"] = torch.cat([hf[x + "gate_proj.weight"][eb * f:(eb + 1) * f],
                                                      hf[x + "up_proj.weight"][eb * f:(eb + 1) * f]])
            out[q + "linear_fc2.weight"] = hf[x + "down_proj.weight"][:, eb * f:(eb + 1) * f].clone()
    return out


def moe_engine_shards(shape, hf, n, b, chunk) -> dict:
    """Engine-format tensors of gen TP rank b of n: every expert's [gate; up] rows and down
    columns of the rank's F slice, the router and q/k norms whole."""
    out = {k: v for k, v in engine_shards(shape, _dense_view(shape, hf), n, b, 1, 0, chunk).items()
           if ".mlp." not in k}
    f = shape.moe_ffn_hidden_size // n
    for L in range(shape.layers):
        h = f"model.layers.{L}."
        for name in ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate.weight"):
            out[h + name] = hf[h + name]
        for e in range(shape.num_experts):
            x = f"{h}mlp.experts.{e}."
            out[x + "gate_up_proj.weight"] = torch.cat([hf[x + "gate_proj.weight"][b * f:(b + 1) * f],
                                                        hf[x + "up_proj.weight"][b * f:(b + 1) * f]])
            out[x + "down_proj.weight"] = hf[x + "down_proj.weight"][:, b * f:(b + 1) * f]
    return out


def moe_setup(world: int, tp: int, ep: int, etp: int, tg: int, shape=MOE, bucket_mb=0.004,
              grouping: str = "auto"):
    """(train placement, gen placement, plan) of one layout (pure)."""
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.reshard.placement import gen_placement, train_placement
    from hybridrl.reshard.planner import plan_reshard

    tl = TrainLayout(world, tp=tp, pp=1)
    train = train_placement(tl, shape, ep=ep, etp=etp)
    gen = gen_placement(tl, shape, tg, 1, grouping, vocab_pad=64)
    return train, gen, plan_reshard(train, gen, build_specs(shape), bucket_mb=bucket_mb,
                                    itemsize=4)


def rank_shards(shape, hf, train, rank: int) -> dict:
    """The oracle's megatron tensors of ``rank`` of the training placement."""
    b, _, _ = train.coords[rank]
    eb, er = train.expert_coords(rank)
    return moe_megatron_shards(shape, hf, train.tp, b, train.vocab_chunk, train.ep, er,
                               train.expert_tp, eb)


def held_bytes(plan, rank: int) -> int:
    """Bytes of ``rank``'s gen destination it holds itself in training."""
    n = 0
    for spec in plan.specs:
        d, h = plan.gen.interval(spec, rank), plan.train.interval(spec, rank)
        if d is not None and h is not None:
            n += max(0, min(d[1], h[1]) - max(d[0], h[0])) * spec.row_numel * plan.itemsize
    return n


LAYOUTS = [  # (world, tp, ep, etp, gen tp)
    (2, 1, 1, 1, 1), (2, 1, 2, 1, 1), (2, 1, 2, 1, 2), (4, 2, 2, 2, 1), (4, 2, 2, 1, 2),
    (4, 1, 4, 1, 2), (4, 2, 1, 2, 4), (4, 2, 2, 2, 4)]


@pytest.mark.parametrize("world, tp, ep, etp, tg", LAYOUTS)
def test_moe_reshard_is_bit_identical_and_moves_only_missing_rows(world, tp, ep, etp, tg):
    from hybridrl.reshard.assemble import Assembler
    from hybridrl.reshard.executor import run_plan_local, train_sources
    from hybridrl.reshard.formats import engine_format

    hf = make_moe_hf(MOE)
    train, gen, plan = moe_setup(world, tp, ep, etp, tg)
    sources = [train_sources(plan, r, rank_shards(MOE, hf, train, r)) for r in range(world)]
    got = [{} for _ in range(world)]
    asms = [Assembler(plan, r, engine_format(MOE, gen, r),
                      sink=lambda named, r=r: got[r].update(named)) for r in range(world)]
    run_plan_local(plan, sources, asms)
    for r in range(world):
        want = moe_engine_shards(MOE, hf, tg, gen.coords[r][0], gen.vocab_chunk)
        assert sorted(got[r]) == sorted(want), r
        bad = [k for k in want if not torch.equal(got[r][k], want[k])]
        assert not bad, (r, bad[:3])
        assert plan.recv_bytes(r) == plan.dest_bytes(r) - held_bytes(plan, r), r
    assert len(plan.buckets) < sum(1 for s in plan.specs if s.expert is not None)  # bucketed


def test_moe_specs_names_and_expert_placement():
    specs = build_specs(MOE)
    experts = [s for s in specs if s.expert is not None]
    assert len(experts) == 2 * MOE.layers * MOE.num_experts
    fc1 = next(s for s in experts if s.expert == 5 and s.layer == 1 and s.kind == "fc1")
    assert fc1.name == "decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"
    assert fc1.local_name(1, MOE.layers, 2) == "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"
    assert "decoder.layers.0.mlp.router.weight" in {s.name for s in specs}
    assert not any("mlp.linear_fc1" in s.name for s in specs)
    train, gen, _ = moe_setup(4, 2, 2, 1, 2)
    # megatron's expert ranks: expert tp (1) fastest, then ep: ranks 0,2 EP rank 0; 1,3 EP rank 1
    assert [train.expert_coords(r) for r in range(4)] == [(0, 0), (0, 1), (0, 0), (0, 1)]
    assert train.interval(fc1, 0) is None and train.interval(fc1, 1) == (0, 12)
    assert gen.interval(fc1, 3) == (6, 12)  # gen: every rank every expert, F over gen tp
    dense = LlamaShape(**{**MOE.__dict__, "num_experts": 0, "moe_topk": 0,
                          "moe_ffn_hidden_size": None})
    assert [s.name for s in build_specs(dense)] == [
        s.name for s in build_specs(LlamaShape(16, 24, 8, 4, 2, 60, 4, False, 8, qk_norm=True))]


def test_moe_hf_export_round_trip():
    from hybridrl.reshard.formats import hf_format, hf_to_canonical

    hf = make_moe_hf(MOE)
    canon = hf_to_canonical(MOE, hf)
    fmt = hf_format(MOE)
    out = dict(kv for s in build_specs(MOE) if not s.tied_copy for kv in fmt(s, canon[s.key]))
    assert sorted(out) == sorted(hf)
    assert all(torch.equal(out[k], hf[k]) for k in hf)


@pytest.mark.parametrize("tp, ep, etp, tg, match", [
    (1, 3, 1, 1, "ep=3 must divide num_experts=8"),
    (1, 2, 8, 1, "expert tp=8 must divide moe_ffn_hidden_size=12"),
    (1, 1, 1, 8, "gen tp=8"),
])
def test_moe_bad_splits_are_one_line(tp, ep, etp, tg, match):
    with pytest.raises(ValueError, match=match):
        moe_setup(8 if tg == 8 else 24, tp, ep, etp, tg)


@pytest.mark.parametrize("world, pp, etp, ep", [(4, 1, 2, 2), (8, 2, 2, 2), (8, 1, 1, 4),
                                                (16, 2, 2, 2)])
def test_expert_coords_are_megatron_expert_rank_generator(world, pp, etp, ep):
    from megatron.core.parallel_state import RankGenerator

    from hybridrl.reshard.placement import expert_coords

    gen = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1,
                        order="tp-cp-ep-dp-pp")
    want = {}
    for axis, k in (("tp", 0), ("ep", 1)):
        for group in gen.get_ranks(axis):
            for i, r in enumerate(group):
                want.setdefault(r, [0, 0])[k] = i
    assert list(expert_coords(world, pp, etp, ep)) == [tuple(want[r]) for r in range(world)]


def test_train_placement_reads_the_layouts_expert_sizes():
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.reshard.placement import expert_coords, train_placement

    layout = TrainLayout(8, tp=2, pp=1, ep=2, etp=1)
    train = train_placement(layout, MOE)
    assert (train.ep, train.expert_tp) == (2, 1)
    assert train.experts == expert_coords(8, 1, 1, 2)
    assert [train.replica(r) for r in range(8)] == [layout.coords(r)["dp"] for r in range(8)]


def test_split_placement_sends_each_expert_from_its_ep_ranks():
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.planning.split import split_report
    from hybridrl.reshard.placement import split_placements
    from hybridrl.reshard.planner import SPLIT, plan_reshard

    train, gen = split_placements(TrainLayout(4, tp=1, pp=1, ep=4), MOE, 2, 2, 1, 64)
    plan = plan_reshard(train, gen, build_specs(MOE), SPLIT, 1.0, 2)
    for t in (t for b in plan.buckets for t in b):
        spec = plan.spec(t.key)
        if spec.expert is not None:  # 8 experts over ep 4: rank r holds 2r, 2r + 1
            assert t.src == spec.expert // 2 and t.dst >= 4, t
    rep = split_report(MOE, 6, 1, 1, 2, 2, 2, 1.0, 100, 64, ep=4)
    assert rep["train"]["ep"] == 4
    assert rep["received_per_gen_rank"] == [plan.recv_bytes(r) for r in (4, 5)]
    assert rep["sent_per_train_rank"] == [plan.sent_bytes(r) for r in range(4)]


def test_shape_from_a_megatron_moe_config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    def config(**kw):
        return TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=8,
                                 num_query_groups=4, kv_channels=4, ffn_hidden_size=24,
                                 normalization="RMSNorm", gated_linear_unit=True,
                                 add_bias_linear=False, qk_layernorm=True, num_moe_experts=8,
                                 moe_router_topk=2, moe_ffn_hidden_size=12, **kw)

    shape = LlamaShape.from_model(config(), vocab=60, make_vocab_size_divisible_by=8)
    assert shape == MOE
    shape = LlamaShape.from_model(config(moe_router_pre_softmax=True), vocab=60)
    assert not shape.moe_norm_topk_prob
    with pytest.raises(ValueError, match="moe_shared_expert_intermediate_size"):
        LlamaShape.from_model(config(moe_shared_expert_intermediate_size=8), vocab=60)


def test_te_grouped_expert_names():
    from hybridrl.reshard.formats import hf_name

    te = [s for s in build_specs(MOE, "te") if s.expert == 5 and s.layer == 1]
    assert [s.name for s in te] == ["decoder.layers.1.mlp.experts.linear_fc1.weight5",
                                    "decoder.layers.1.mlp.experts.linear_fc2.weight5"]
    assert te[1].local_name(1, MOE.layers, 2) == "decoder.layers.1.mlp.experts.linear_fc2.weight1"
    assert [hf_name(s) for s in te] == ["model.layers.1.mlp.experts.5.gate_up_proj.weight",
                                        "model.layers.1.mlp.experts.5.down_proj.weight"]
    # an expert index that ends like another (15 vs 5) keeps its own local index
    big = LlamaShape(**{**MOE.__dict__, "num_experts": 16})
    s15 = next(s for s in build_specs(big, "te") if s.expert == 15 and s.kind == "row")
    assert s15.local_name(1, big.layers, 2).endswith("linear_fc2.weight7")
