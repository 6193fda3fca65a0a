"""Memory plan of MoE models (issue 38 item 6): experts over ep x etp, their optimizer state
over edp, router logits and dispatcher buffers; configs/qwen3_30b_a3b_32gpu.yaml fits."""

import os

import pytest

from hybridrl.config.loader import load_config
from hybridrl.planning.memory import MemoryJob, model_state_bytes, plan_memory, stage_numel
from hybridrl.planning.moe_memory import expert_numel, moe_activation_parts
from hybridrl.planning.report import format_report, job_from_config
from hybridrl.reshard.specs import LlamaShape, build_specs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the published config.json sizes (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B)
A3B = LlamaShape(2048, 6144, 32, 4, 48, 151936, head_dim=128, qk_norm=True, num_experts=128,
                 moe_topk=8, moe_ffn_hidden_size=768)
A22B = LlamaShape(4096, 12288, 64, 4, 94, 151936, head_dim=128, qk_norm=True, num_experts=128,
                  moe_topk=8, moe_ffn_hidden_size=1536)
DENSE = LlamaShape(4096, 12288, 32, 8, 36, 151936, head_dim=128, qk_norm=True)


def test_presets_have_the_published_sizes():
    assert round(A3B.num_params() / 1e9, 1) == 30.5
    assert round(A22B.num_params() / 1e9) == 235


@pytest.mark.parametrize("shape", [A3B, A22B])
def test_every_expert_is_held_once_per_expert_replica(shape):
    experts = sum(s.numel for s in build_specs(shape) if s.expert is not None)
    for tp, pp, ep, etp in [(1, 1, 1, 1), (2, 2, 8, 2), (4, 1, 8, 1), (8, 2, 32, 1)]:
        held = sum(expert_numel(shape, pp, stage, ep, etp) for stage in range(pp))
        assert held * ep * etp == experts
        dense = sum(stage_numel(shape, tp, pp, stage, ep=ep, etp=etp) for stage in range(pp))
        assert dense > held  # the rank also holds its dense slice


def test_expert_optimizer_state_is_sharded_over_expert_dp():
    """Distributed optimizer: expert moments / edp, dense / dp. Raising ep shrinks the expert
    weights and grads a rank holds; the optimizer share stays expert bytes / world."""
    rows = {}
    for ep in (1, 2, 4, 8, 16, 32):
        job = MemoryJob(shape=A3B, world=32, tp=1, pp=1, ep=ep, dtype="bf16")
        parts = model_state_bytes(job, "actor", 0)
        experts = expert_numel(A3B, 1, 0, ep, 1)
        dense = stage_numel(A3B, 1, 1, 0, ep=ep, etp=1) - experts
        assert parts["optim"] == dense * 12 // 32 + experts * 12 // job.edp
        rows[ep] = parts
    assert rows[32]["params"] < rows[8]["params"] < rows[1]["params"]
    assert rows[1]["params"] > 8 * rows[32]["params"]
    assert abs(rows[1]["optim"] - rows[32]["optim"]) < 1e-3 * rows[1]["optim"]


def test_moe_activations_scale_with_topk_and_expert_tp():
    base = moe_activation_parts(A3B, 8192, 1, 1, 1, False, 2, "te")
    assert base["moe_dispatch"] == 8192 * 8 * 2 * 2048 * 2  # k routed copies, 2 buffers
    assert base["router_logits"] == 8192 * 128 * (2 + 4)
    split = moe_activation_parts(A3B, 8192, 1, 4, 4, True, 2, "te")
    assert split["experts"] * 4 == base["experts"] and split["router_logits"] * 4 == \
        base["router_logits"]
    assert moe_activation_parts(DENSE, 8192, 1, 1, 1, False, 2, "te") == {}


def test_bad_expert_layouts_are_one_line():
    with pytest.raises(ValueError, match=r"--world 32 is not divisible by etp\*ep\*pp = 4\*16\*1"):
        MemoryJob(shape=A3B, world=32, tp=4, ep=16)
    with pytest.raises(ValueError, match="--ep 3 must divide num_experts=128"):
        MemoryJob(shape=A3B, world=24, tp=1, ep=3)
    with pytest.raises(ValueError, match="need a mixture-of-experts model"):
        MemoryJob(shape=DENSE, world=8, ep=2)


def _plan(overrides=(), shape=A3B, world=32):
    cfg = load_config([os.path.join(ROOT, "configs", "qwen3_30b_a3b_32gpu.yaml")],
                      overrides=list(overrides))
    return plan_memory(job_from_config(cfg, shape, world, 80.0))


def test_qwen3_30b_a3b_config_fits_32_gpus_and_needs_ep():
    cfg = load_config([os.path.join(ROOT, "configs", "qwen3_30b_a3b_32gpu.yaml")])
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep) == (4, 1, 8)
    assert cfg.check_world(32) == 8
    rep = _plan()
    assert rep["fits"] and rep["moe"]["edp"] == 1 and rep["gen_concurrent_seqs"] >= 64
    text = format_report(rep, "qwen3-30b-a3b")
    assert "experts: ep 8 x etp 4, optimizer state over edp 1" in text
    assert not _plan(["parallel.ep=1", "parallel.etp=1"])["fits"]  # the experts do not fit
    assert not _plan(["parallel.ep=4", "parallel.etp=1"])["fits"]


def test_qwen3_235b_a22b_fits_256_gpus_with_offload_and_wide_ep():
    big = ["model.path=models/Qwen3-235B-A22B", "parallel.tp=8", "parallel.pp=2",
           "parallel.etp=1", "parallel.gen.tp=8", "parallel.gen.pp=2",
           "actor.param_offload=true", "actor.grad_offload=true",
           "actor.optimizer_offload=true", "ref.param_offload=true"]
    wide = _plan(big + ["parallel.ep=64"], A22B, 256)
    assert wide["fits"] and wide["moe"]["edp"] == 2
    narrow = _plan(big + ["parallel.ep=16"], A22B, 256)
    assert narrow["totals"]["train_actor"] > wide["totals"]["train_actor"] + 20e9


def test_plan_cli_takes_ep_and_etp(capsys):
    """`hybridrl plan --ep/--etp` (the reshard dry run, --memory, --gen-world) lays the experts
    out over ep as the trainer does: at ep 8 x etp 1 a gen-TP-4 rank lacks the experts its
    training rank does not hold (~12.7 GB for Qwen3-30B-A3B); before the flags the plan took
    ep 1 (every expert local: ~0 GB moved) and --memory counted unsharded experts."""
    import json

    from hybridrl.planning.cli import main

    def recv(*flags):
        assert main(["--model", "qwen3-30b-a3b", "--world", "32", "--tp", "4", "--gen-tp", "4",
                     "--json", *flags]) == 0
        rep = json.loads(capsys.readouterr().out)
        return rep["strategies"]["zero_redundancy"]["max_bytes_received_per_rank"] / 1e9

    assert recv("--ep", "8", "--etp", "1") > 10.0 > 0.1 > recv()
    assert main(["--model", "qwen3-30b-a3b", "--world", "32", "--tp", "4", "--gen-tp", "4",
                 "--memory", "--ep", "8", "--etp", "1", "--json"]) == 0
    sharded = json.loads(capsys.readouterr().out)
    assert main(["--model", "qwen3-30b-a3b", "--world", "32", "--tp", "4", "--gen-tp", "4",
                 "--memory", "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert sharded["job"]["ep"] == 8
    assert max(sharded["totals"].values()) < max(whole["totals"].values())
