"""SGLang 0.5.21's real Qwen3MoeForCausalLM on CPU (4 gloo ranks, one launch; the test-only
prelude lets its modules import), at gen tp 1, 2 and 4: the reshard from megatron training
shards (tp 2, ep 2, expert tp 1; the oracle of tests/unit/test_moe_reshard.py) in the engine
format, loaded per rank by ``hybridrl.rollout.sglang.loader.load_direct`` (what SGLang's
``update_weights_from_tensor`` calls for a custom loader), leaves every parameter bitwise equal
to SGLang's own ``load_weights`` on the full HF tensors (per-expert checkpoint names). The
per-rank shapes equal ``engine_param_shapes(..., moe_loader=True)``.
"""

from __future__ import annotations

import os

import pytest
import torch

from hybridrl.testing.dist import run_on_ranks

WORLD = 4


def _hf_config(shape):
    import transformers

    return transformers.Qwen3MoeConfig(
        hidden_size=shape.hidden, intermediate_size=shape.ffn,
        moe_intermediate_size=shape.moe_ffn_hidden_size, num_experts=shape.num_experts,
        num_experts_per_tok=shape.moe_topk, norm_topk_prob=True, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.num_query_groups,
        head_dim=shape.head_dim, vocab_size=shape.vocab, tie_word_embeddings=False,
        torch_dtype="float32")


def _tp_coordinator(tg: int):
    """tests/support/sglang_real.tp_coordinator plus SGLang's MoE widths and ranks at ep 1
    (moe_tp = tp), published in the same override (SGLang validates them together)."""
    import torch.distributed as dist
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import get_parallel

    world = dist.get_world_size()
    opts = dict(use_pynccl=False, use_custom_allreduce=False)
    tp = ps.init_model_parallel_group([list(range(i, i + tg)) for i in range(0, world, tg)], 0,
                                      "gloo", group_name=f"moe_tp{tg}", **opts)
    pp = ps.init_model_parallel_group([[r] for r in range(world)], 0, "gloo",
                                      group_name=f"moe_pp{tg}", **opts)
    r = tp.rank_in_group
    get_parallel().override_permanently(
        tp_size=tg, tp_rank=r, pp_size=1, pp_rank=0, attn_tp_size=tg, attn_tp_rank=r,
        attn_dp_size=1, attn_dp_rank=0, attn_cp_size=1, attn_cp_rank=0, tp_group=tp,
        pp_group=pp, attn_tp_group=tp, moe_ep_size=1, moe_ep_rank=0, moe_dp_size=1,
        moe_dp_rank=0, moe_tp_size=tg, moe_tp_rank=r)
    return tp


def _case(rank, world, tg, root):
    from sglang.srt.arg_groups.boundary_reduction import model_boundary_reduction
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

    from hybridrl.reshard.assemble import Assembler
    from hybridrl.reshard.executor import run_plan, train_sources
    from hybridrl.reshard.formats import engine_format
    from hybridrl.rollout.sglang.layout import engine_param_shapes
    from hybridrl.rollout.sglang.loader import load_direct
    from tests.support import sglang_real as real
    from tests.unit.test_moe_reshard import MOE, make_moe_hf, moe_setup, rank_shards

    cfg = _hf_config(MOE)
    path = os.path.join(root, f"qwen3moe_tp{tg}")
    if rank == 0:
        cfg.save_pretrained(path)
    torch.distributed.barrier()
    real.publish({"model_path": path, "tp_size": tg, "load_format": "dummy", "dtype": "float32",
                  "skip_tokenizer_init": True, "boundary_reduction": model_boundary_reduction(cfg)})
    tp = _tp_coordinator(tg)
    r = tp.rank_in_group
    pushed, reference = Qwen3MoeForCausalLM(cfg, None), Qwen3MoeForCausalLM(cfg, None)
    real.nan_fill(pushed)
    hf = make_moe_hf(MOE, seed=11)
    reference.load_weights(list(hf.items()))  # SGLang's own load path, full HF tensors
    # gen-TP groups in SGLang's order (consecutive ranks), as the worker's sglang_gen_placement
    train, gen, plan = moe_setup(world, 2, 2, 1, tg, bucket_mb=0.01,
                                 grouping="hybridflow" if 2 % tg == 0 else "consecutive")
    assert gen.coords[rank][0] == r, (gen.coords[rank], r)  # gen-TP order == SGLang's TP order
    named = rank_shards(MOE, hf, train, rank)
    got = []
    asm = Assembler(plan, rank, engine_format(MOE, gen, rank), sink=got.extend,
                    sink_every_flush=True)
    run_plan(plan, train_sources(plan, named), asm)
    table = engine_param_shapes(MOE, tg, moe_loader=True)
    load_direct(pushed, got)
    want, have = dict(reference.named_parameters()), dict(pushed.named_parameters())
    return {"differ": sorted(n for n in want if not torch.equal(have[n], want[n])),
            "bad_shapes": sorted(n for n, t in got if table.get(n) != tuple(t.shape)),
            "loaded": len(got), "table": len(table)}


def _all(rank, world, root):
    from tests.support.sglang_prelude import install

    install()
    return {tg: _case(rank, world, tg, root) for tg in (1, 2, 4)}


@pytest.mark.slow
def test_sglang_qwen3_moe_loads_the_resharded_experts_bitwise(tmp_path):
    results = run_on_ranks(_all, WORLD, str(tmp_path), timeout=600)
    for rank, per_tp in enumerate(results):
        for tg, out in per_tp.items():
            assert out["differ"] == [] and out["bad_shapes"] == [], (rank, tg, out)
            assert out["loaded"] == out["table"], (rank, tg, out)  # every tensor, once
