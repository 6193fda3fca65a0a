"""``hybridrl plan --time``: the phase formulas against hand calculations, monotonicity, the CLI.

The hand calculations use a small llama shape and a made-up accelerator whose efficiencies are
all 1.0, so every expected number below is the formula of docs/scaling.md worked by hand.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from hybridrl.planning import flops as F
from hybridrl.planning.cli import main
from hybridrl.planning.hardware import GPUS, Hardware, hardware
from hybridrl.planning.memory import stage_numel
from hybridrl.planning.timing import (
    OPTIMIZER_BYTES_PER_PARAM,
    Layout,
    Workload,
    generate_s,
    offload_bytes,
    predict,
)
from hybridrl.reshard.specs import LlamaShape

SHAPE = LlamaShape(hidden=64, ffn=128, heads=4, num_query_groups=2, layers=2, vocab=100)
ONE = (("matmul", 1.0), ("hbm", 1.0), ("link", 1.0), ("pcie", 1.0))
HW = Hardware("test", flops=1e12, hbm_bytes=80e9, hbm_bps=1e12, nvlink_bps=1e11, ib_bps=1e10,
              pcie_bps=1e10, gpus_per_node=8, collective_latency_s=0.0, efficiency=ONE)


def test_flops_by_hand():
    # QKV 64 x (64 + 2 x 32), output 64 x 64, SwiGLU 3 x 64 x 128, 2 FLOPs per multiply-add
    assert F.layer_matmul_flops(SHAPE) == 2 * (64 * 128 + 64 * 64 + 3 * 64 * 128) == 73728
    # causal: 10 tokens attend to 1 + 2 + ... + 10 = 55 positions, QK^T and AV: 2 x 2 x 64
    assert F.attention_flops(SHAPE, 10) == 4 * 64 * 55 == 14080
    fwd = 2 * (73728 * 10 + 14080) + 2 * 64 * 100 * 10
    assert F.forward_flops(SHAPE, 10) == fwd
    assert F.forward_flops(SHAPE, 10, "critic") == fwd - 2 * 64 * 100 * 10 + 2 * 64 * 10
    assert F.model_flops(SHAPE, 10) == 3 * fwd
    assert F.train_flops(SHAPE, 10, recompute="full") == 4 * fwd - 2 * 64 * 100 * 10
    assert F.train_flops(SHAPE, 10, recompute="selective") == 3 * fwd + 2 * 14080
    # decode at 20 tokens of context: matmuls + 4 x a x context per layer, then the logits
    assert F.decode_token_flops(SHAPE, 20) == 2 * (73728 + 4 * 64 * 20) + 2 * 64 * 100
    # GQA: K and V of 2 groups x 16 dims, 2 layers, 2 bytes
    assert F.kv_bytes_per_token(SHAPE, 2) == 2 * 2 * 2 * 16 * 2


def test_generate_by_hand():
    work = Workload(prompts=4, n=2, prompt_len=10, response_len=6, max_response_len=8)
    lay = Layout(world=2, gen_tp=1)  # 2 replicas of 4 sequences each
    total, d = generate_s(work, lay, HW, SHAPE, concurrent=4)
    # each replica's 4 sequences are 2 prompts x n 2: each prompt is prefilled once
    prefill = 2 * F.forward_flops(SHAPE, 10) / 1e12
    weights = SHAPE.num_params() * 2
    kv = 4 * 13 * F.kv_bytes_per_token(SHAPE, 2)  # batch 4, mean context 10 + 6 / 2
    step = max((weights + kv) / 1e12, 4 * F.decode_token_flops(SHAPE, 13) / 1e12)
    assert d["decode_steps"] == 8  # all 4 fit the batch: the longest response's steps
    assert total == pytest.approx(prefill + 8 * step)
    # half the batch: continuous batching, 4 x 6 / 2 steps + the tail (8 - 6)
    total2, d2 = generate_s(work, lay, HW, SHAPE, concurrent=2)
    assert d2["decode_steps"] == pytest.approx(4 * 6 / 2 + 2)
    kv2 = 2 * 13 * F.kv_bytes_per_token(SHAPE, 2)
    step2 = max((weights + kv2) / 1e12, 2 * F.decode_token_flops(SHAPE, 13) / 1e12)
    assert total2 == pytest.approx(prefill + 14 * step2)
    # CPU: each forward (the prefill and every decode step) also pays a call per layer and
    # the head, and each decode step one draw per request
    cpu = dataclasses.replace(HW, kernel_latency_s=1e-4, sample_latency_s=1e-3)
    cpu_total, _ = generate_s(work, lay, cpu, SHAPE, concurrent=4)
    assert cpu_total == pytest.approx(total + (2 + 1) * 1e-4 + 8 * ((2 + 1) * 1e-4 + 4 * 1e-3))
    # tensor-parallel generation: weights and KV split over tg ranks, 2 all-reduces per layer
    # and 3 small collectives (embedding, logits, tokens) per forward, the prefill's included
    lat = Hardware("lat", flops=1e15, hbm_bytes=80e9, hbm_bps=1e12, nvlink_bps=1e11,
                   ib_bps=1e10, pcie_bps=1e10, collective_latency_s=1e-5, efficiency=ONE)
    tp_total, _ = generate_s(work, Layout(world=2, gen_tp=2), lat, SHAPE, concurrent=8)
    msg = 8 * 64 * 2  # the batch's hidden states, 2 bytes
    ring = 2 * (2 - 1) / 2 * msg / 1e11 + 1e-5
    prompt_ring = 2 * (2 - 1) / 2 * (4 * 10 * 64 * 2) / 1e11 + 1e-5  # 4 prompts of 10 tokens
    kv8 = 8 * 13 * F.kv_bytes_per_token(SHAPE, 2) / 2
    step8 = (weights / 2 + kv8) / 1e12  # HBM-bound at this peak
    assert 8 * F.decode_token_flops(SHAPE, 13) / 2e15 < step8
    assert tp_total == pytest.approx(4 * F.forward_flops(SHAPE, 10) / 2e15 + 2 * 2 * prompt_ring
                                     + 3e-5 + 8 * (step8 + 2 * 2 * ring + 3e-5))


def test_cpu_terms_by_hand():
    """The per-token activation traffic, the layer calls and ranks sharing cores."""
    work = Workload(prompts=4, n=2, prompt_len=10, response_len=6, max_response_len=8)
    lay = Layout(world=2, gen_tp=1)
    base, _ = generate_s(work, lay, HW, SHAPE, concurrent=4)
    cpu = dataclasses.replace(HW, act_passes=3.0)
    total, _ = generate_s(work, lay, cpu, SHAPE, concurrent=4)
    # 3 vectors per token: the 2 prompts' 10 tokens through 2 layers of 64 and their last
    # token through the head (100), then each decode step's 4 tokens through both, 2 bytes
    prefill = 3 * (2 * 10 * 2 * 64 + 2 * 100) * 2 / 1e12
    step = 3 * (4 * 2 * 64 + 4 * 100) * 2 / 1e12
    assert total == pytest.approx(base + prefill + 8 * step)
    # 4 ranks on 2 cores: every phase twice as long; on 4 cores as before
    wide = Layout(world=4, gen_tp=1)
    alone, _ = generate_s(work, wide, HW, SHAPE, concurrent=4)
    assert generate_s(work, wide, dataclasses.replace(HW, cores=2), SHAPE, 4)[0] == \
        pytest.approx(2 * alone)
    assert generate_s(work, wide, dataclasses.replace(HW, cores=4), SHAPE, 4)[0] == alone
    # a forward pass: 8 sequences of 16 tokens on one rank, 2 per micro-batch (32-token budget)
    one = Layout(world=1, ref=False, tokens_per_gpu=32)
    fwd = Workload(prompts=4, n=2, prompt_len=10, response_len=6, max_response_len=8)
    plain = predict(fwd, one, HW, SHAPE, _mem(), {"intra_node_bytes": 0, "inter_node_bytes": 0})
    calls = dataclasses.replace(HW, kernel_latency_s=1e-3, act_passes=2.0)
    rep = predict(fwd, one, calls, SHAPE, _mem(), {"intra_node_bytes": 0, "inter_node_bytes": 0})
    # 4 micro-batches x (2 layers + the head) calls; 2 vectors per token of 2 x 64 + 100
    extra = 4 * 3 * 1e-3 + 2 * 8 * 16 * (2 * 64 + 100) * 2 / 1e12
    assert rep["phases_s"]["old_log_prob"] == pytest.approx(
        plain["phases_s"]["old_log_prob"] + extra)
    # training: train_calls x the calls, train_act_ratio x the traffic
    calls2 = dataclasses.replace(calls, train_calls=2.5, train_act_ratio=4.0)
    rep2 = predict(fwd, one, calls2, SHAPE, _mem(), {"intra_node_bytes": 0,
                                                     "inter_node_bytes": 0})
    extra2 = 2.5 * 4 * 3 * 1e-3 + 4.0 * 2 * 8 * 16 * (2 * 64 + 100) * 2 / 1e12
    assert rep2["phases_s"]["actor_update"] == pytest.approx(
        plain["phases_s"]["actor_update"] + extra2)


def test_shared_prompts_by_hand():
    """Packed micro-batches that compute a prompt once for its rows (the local spec)."""
    # prompt 10 tokens: 9 are computed once for the rows sharing it, the rest per row
    assert F.shared_tokens(10, 16, 4) == 16 - 0.75 * 9
    assert F.shared_forward_flops(SHAPE, 10, 16, 4) == pytest.approx(
        F.forward_flops(SHAPE, 16) - 0.75 * F.forward_flops(SHAPE, 9))
    assert F.shared_forward_flops(SHAPE, 10, 16, 1) == F.forward_flops(SHAPE, 16)
    work = Workload(prompts=4, n=4, prompt_len=10, response_len=6, max_response_len=8)
    mem, none = _mem(), {"intra_node_bytes": 0, "inter_node_bytes": 0}
    # 2 sequences per micro-batch (32 tokens), both of one prompt: 2 rows share it
    lay = Layout(world=1, ref=False, tokens_per_gpu=32, share_prompts=True)
    plain = predict(work, dataclasses.replace(lay, share_prompts=False), HW, SHAPE, mem, none)
    rep = predict(work, lay, HW, SHAPE, mem, none)
    saved = 16 * 0.5 * F.forward_flops(SHAPE, 9) / 1e12
    assert rep["phases_s"]["old_log_prob"] == pytest.approx(
        plain["phases_s"]["old_log_prob"] - saved)
    assert rep["phases_s"]["actor_update"] == pytest.approx(
        plain["phases_s"]["actor_update"] - 3 * saved)


def test_parallel_messages_by_hand():
    """Each TP collective and pipeline message of a pass pays the collective latency."""
    work = Workload(prompts=8, n=1, prompt_len=10, response_len=6, max_response_len=6)
    none = {"intra_node_bytes": 0, "inter_node_bytes": 0}
    lat = 1e-3
    free = dataclasses.replace(HW, nvlink_bps=1e30, ib_bps=1e30)  # latency alone
    slow = dataclasses.replace(free, collective_latency_s=lat)

    def phases(lay, hw):
        return predict(work, lay, hw, SHAPE, _mem(), none)["phases_s"]
    # tp 2: 2 micro-batches of 4 sequences; a forward's 2 all-reduces per layer (2 layers) + 5
    # (embedding; vocab-parallel log-prob: max, sum, target, entropy), a training pass's
    # backward 2 per layer + 1 (the output layer's input gradient)
    tp = Layout(world=2, tp=2, tokens_per_gpu=64, ref=False)
    base, timed = phases(tp, free), phases(tp, slow)
    assert timed["old_log_prob"] - base["old_log_prob"] == pytest.approx(2 * (2 * 2 + 5) * lat)
    assert timed["actor_update"] - base["actor_update"] == pytest.approx(
        2 * ((2 * 2 + 5) + (2 * 2 + 1)) * lat)
    # pp 2: each micro-batch hop sends its shape, then the tensor (2 messages; training: the
    # activations forward and their gradients back), and the pass's results leave the last
    # stage once (2 messages); the 1F1B bubble stretches neither
    pp = Layout(world=2, pp=2, tokens_per_gpu=64, ref=False)
    base, timed = phases(pp, free), phases(pp, slow)
    assert timed["old_log_prob"] - base["old_log_prob"] == pytest.approx((2 * 2 + 2) * lat)
    assert timed["actor_update"] - base["actor_update"] == pytest.approx((2 * 2 * 2 + 2) * lat)
    # tp 2 x pp 2: a stage's TP collectives (2 for its 1 layer + the head's 4) are inside its
    # pipeline slot, so the bubble stretches them: (m + p - 1) / m = 3 / 2
    both = Layout(world=4, tp=2, pp=2, tokens_per_gpu=64, ref=False)
    base, timed = phases(both, free), phases(both, slow)
    assert timed["old_log_prob"] - base["old_log_prob"] == pytest.approx(
        (2 * (2 + 4) * 3 / 2 + 2 * 2 + 2) * lat)
    # dp 2 with the distributed optimizer, per optimizer step: the gradients' reduce-scatter
    # and the parameters' all-gather, and the loss normalizers' 2 counts
    dp = Layout(world=2, tokens_per_gpu=64, ref=False)
    base, timed = phases(dp, free), phases(dp, slow)
    assert timed["old_log_prob"] == base["old_log_prob"]
    assert timed["actor_update"] - base["actor_update"] == pytest.approx((2 + 2) * lat)
    # the distributed optimizer's own fixed cost at dp > 1 (CPU: measured), once per step
    costly = dataclasses.replace(free, dp_step_latency_s=0.25)
    assert phases(dp, costly)["actor_update"] - base["actor_update"] == pytest.approx(0.25)
    assert phases(Layout(world=1, tokens_per_gpu=64, ref=False), costly)["actor_update"] == \
        phases(Layout(world=1, tokens_per_gpu=64, ref=False), free)["actor_update"]
    # 2 cores: at world 4 the compute takes twice as long, the collectives' waits do not
    crowded = dataclasses.replace(slow, cores=2)
    four = Layout(world=4, tp=2, pp=2, tokens_per_gpu=64, ref=False)
    base = phases(four, dataclasses.replace(free, cores=2))
    assert phases(four, crowded)["old_log_prob"] - base["old_log_prob"] == pytest.approx(
        (2 * (2 + 4) * 3 / 2 + 2 * 2 + 2) * lat)


def _mem(actor_params=100, actor_optim=1000, ref_params=0):
    return {"gen_concurrent_seqs": 8,
            "phases": {"train_actor": {"actor/params": actor_params, "actor/optim": actor_optim},
                       "forward_only": {"reference/params": ref_params}}}


def test_offload_bytes_follow_the_phases():
    lay = Layout(world=1, offload=frozenset({"params", "optim"}))
    # GRPO with a reference: reshard (actor params on), gen (off), old log-prob (on),
    # reference (actor off, reference on), actor update (reference off, actor params + optim
    # on), back to reshard (optim off): 4 actor-param, 2 reference and 2 optimizer moves
    assert offload_bytes(lay, _mem(ref_params=10), critic=False) == 4 * 100 + 2 * 10 + 2 * 1000
    only_params = Layout(world=1, offload=frozenset({"params"}))
    assert offload_bytes(only_params, _mem(ref_params=10), critic=False) == 4 * 100 + 2 * 10
    assert offload_bytes(Layout(world=1), _mem(), critic=False) == 0


def test_predict_by_hand():
    work = Workload(prompts=8, n=1, prompt_len=10, response_len=6, max_response_len=6,
                    ppo_epochs=2)
    lay = Layout(world=1, tokens_per_gpu=64, ref=False)
    reshard = {"intra_node_bytes": 3e11, "inter_node_bytes": 2e10}
    rep = predict(work, lay, HW, SHAPE, _mem(), reshard)
    ph = rep["phases_s"]
    # 8 sequences of 16 tokens: 4 per 64-token micro-batch, 2 micro-batches, no pipeline
    assert ph["old_log_prob"] == pytest.approx(8 * F.forward_flops(SHAPE, 16) / 1e12)
    # 2 epochs x 1 mini-batch: 2 optimizer steps streaming 34 B per parameter over HBM
    adam = 2 * stage_numel(SHAPE, 1, 1, 0) * OPTIMIZER_BYTES_PER_PARAM / 1e12
    assert ph["actor_update"] == pytest.approx(2 * 8 * F.train_flops(SHAPE, 16) / 1e12 + adam)
    assert ph["reference"] == ph["values"] == ph["critic_update"] == 0
    assert ph["reshard"] == pytest.approx(max(3e11 / 1e11, 2e10 / 1e10))  # NVLink: 3 s
    assert rep["step_s"] == pytest.approx(sum(ph.values()))
    assert rep["tokens_per_s_per_gpu"] == pytest.approx(8 * 16 / rep["step_s"])
    assert rep["mfu"] == pytest.approx(2 * 8 * F.model_flops(SHAPE, 16) / ph["actor_update"]
                                       / 1e12)
    slow_opt = dataclasses.replace(HW, optimizer_latency_s=0.5)  # the CPU's measured fixed cost
    assert predict(work, lay, slow_opt, SHAPE, _mem(), reshard)["phases_s"]["actor_update"] \
        == pytest.approx(ph["actor_update"] + 2 * 0.5)
    # pipeline 2: the 1F1B bubble (p - 1) / (m + p - 1) stretches compute by (m + p - 1) / m
    piped = predict(work, Layout(world=2, pp=2, tokens_per_gpu=64, ref=False), HW, SHAPE,
                    _mem(), reshard)
    m = 2
    assert piped["detail"]["pipeline_bubble"] == pytest.approx(1 / (m + 1))
    pp_compute = 8 * F.forward_flops(SHAPE, 16) / (2 * 1e12) * (m + 1) / m
    assert piped["phases_s"]["old_log_prob"] >= pp_compute
    # split: generation overlaps training, the sync is on the critical path
    split = predict(work, Layout(world=2, placement="split", gen_world=1, tokens_per_gpu=64,
                                 ref=False), HW, SHAPE, _mem(), {"busiest_bytes": 1e10})
    sp = split["phases_s"]
    train = sum(v for k, v in sp.items() if k not in ("generate", "reshard"))
    assert sp["reshard"] == pytest.approx(1.0)  # 1e10 bytes over InfiniBand 1e10 B/s
    assert split["step_s"] == pytest.approx(max(sp["generate"], train) + 1.0)


def _time(argv: list[str], capsys) -> dict:
    assert main(["--time", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_more_gpus_never_slower(capsys):
    base = ["--model", "llama-3.1-8b", "--tp", "2", "--gen-tp", "2", "--prompts", "256",
            "--n", "8", "--prompt-len", "512", "--max-response-len", "1024",
            "--recompute", "full", "--sp", "--offload", "params,grads,optim"]
    steps = []
    for world in (8, 16, 32, 64):
        rep = _time([*base, "--world", str(world)], capsys)
        assert set(rep["phases_s"]) >= {"generate", "reshard", "old_log_prob", "reference",
                                        "values", "actor_update", "critic_update", "offload",
                                        "checkpoint"}
        steps.append(rep["step_s"])
    assert steps == sorted(steps, reverse=True) and steps[-1] < steps[0] / 2


def test_faster_gpu_is_faster_and_longer_responses_slower(capsys):
    base = ["--model", "qwen3-8b", "--world", "16", "--tp", "2", "--gen-tp", "2", "--prompts",
            "128", "--n", "4", "--prompt-len", "256", "--max-response-len", "2048",
            "--recompute", "full", "--sp", "--offload", "params,grads,optim"]
    a100 = _time([*base, "--gpu", "a100"], capsys)["step_s"]
    h100 = _time([*base, "--gpu", "h100"], capsys)["step_s"]
    b200 = _time([*base, "--gpu", "b200"], capsys)["step_s"]
    assert a100 > h100 > b200
    short = _time([*base, "--response-len", "256"], capsys)
    long = _time([*base, "--response-len", "1024"], capsys)
    assert long["phases_s"]["generate"] > short["phases_s"]["generate"]
    assert long["phases_s"]["actor_update"] > short["phases_s"]["actor_update"]


def test_config_and_checkpoint(capsys):
    rep = _time(["--config", "configs/llama70b_256gpu.yaml"], capsys)
    assert rep["layout"] == {**rep["layout"], "world": 256, "tp": 8, "pp": 4, "dp": 8,
                             "gen_tp": 4, "placement": "colocated"}
    assert rep["workload"]["algo"] == "gae" and rep["phases_s"]["critic_update"] > 0
    assert rep["workload"]["save_freq"] == 25 and rep["phases_s"]["checkpoint"] > 0
    assert rep["memory"]["fits"] and rep["phases_s"]["offload"] > 0
    none = _time(["--config", "configs/llama70b_256gpu.yaml", "--save-freq", "0"], capsys)
    assert none["phases_s"]["checkpoint"] == 0


def test_split_config(tmp_path, capsys):
    """A split run config: its training ranks (tp x pp x dp) plus parallel.gen.world."""
    text = open("configs/llama70b_256gpu.yaml").read()
    for a, b in (("device: cuda", "device: cpu"), ("engine: sglang", "engine: builtin"),
                 ("strategy: zero_redundancy", "strategy: auto"), ("  dp: 8\n", "  dp: 4\n"),
                 ("  gen:\n    tp: 4", "  placement: split\n  gen:\n    world: 128\n    tp: 8")):
        assert a in text
        text = text.replace(a, b)
    path = tmp_path / "split.yaml"
    path.write_text(text)
    rep = _time(["--config", str(path)], capsys)
    lay, ph = rep["layout"], rep["phases_s"]
    assert (lay["world"], lay["placement"], lay["gen_world"], lay["dp"], lay["gen_tp"]) == \
        (256, "split", 128, 4, 8)
    train = sum(v for k, v in ph.items() if k not in ("generate", "reshard"))
    assert rep["step_s"] == pytest.approx(max(ph["generate"], train) + ph["reshard"])
    assert rep["memory"]["gen_ranks"]["concurrent"] >= 1


@pytest.mark.parametrize("argv, words", [
    (["--model", "llama-3.1-8b", "--world", "8", "--gen-tp", "1", "--placement", "split"],
     "--gen-world"),
    (["--model", "llama-3.1-8b", "--world", "8", "--gen-tp", "1", "--gpu", "cpu"],
     "hybridrl plan --calibrate"),
    (["--model", "llama-3.1-8b", "--world", "8", "--gen-tp", "1", "--response-len", "4000",
      "--max-response-len", "1024"], "--response-len"),
    (["--model", "llama-3.1-8b", "--world", "8", "--gen-tp", "1", "--max-tokens-per-gpu",
      "1024"], "exceeds --max-tokens-per-gpu"),
])
def test_bad_input_is_one_line(argv, words, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no calibration here
    assert main(["--time", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and words in err


def test_cpu_calibration_cache(tmp_path, monkeypatch, capsys):
    from hybridrl.planning import calibrate

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = calibrate.cache_path()
    assert path.startswith(str(tmp_path / "hybridrl"))
    with pytest.raises(ValueError, match="--calibrate"):
        calibrate.load_calibration()
    cal = {"flops": 5e10, "memory_bps": 5e9, "layer_latency_s": 4e-4,
           "collective_latency_s": 1e-4, "link_bps": 2e9, "memory_bytes": 24e9,
           "train_calls_per_forward": 2.5}
    (tmp_path / "hybridrl").mkdir()
    with open(path, "w") as f:
        json.dump(cal, f)
    hw = hardware("cpu", calibration=calibrate.load_calibration())
    assert (hw.flops, hw.kernel_latency_s, hw.train_calls, hw.eff("matmul")) == \
        (5e10, 4e-4, 2.5, 1.0)
    rep = _time(["--model", "llama-3.2-1b", "--gpu", "cpu", "--world", "2", "--gen-tp", "1",
                 "--spec", "local", "--engine", "builtin", "--dtype", "fp32", "--prompts", "4",
                 "--prompt-len", "16", "--max-response-len", "8"], capsys)
    assert rep["gpu"] == "cpu" and rep["step_s"] > 0
    with open(path, "w") as f:
        json.dump({"flops": 1.0}, f)
    with pytest.raises(ValueError, match="layer_latency_s"):
        calibrate.load_calibration()


def test_datasheet_table():
    # dense BF16 (half the sparse figure), HBM and memory size of each SXM part
    assert (GPUS["h100"].flops, GPUS["h100"].hbm_bps, GPUS["h100"].hbm_bytes) == \
        (989e12, 3.35e12, 80e9)
    assert GPUS["h200"].flops == GPUS["h100"].flops and GPUS["h200"].hbm_bytes == 141e9
    assert GPUS["a100"].flops == 312e12 and GPUS["b200"].hbm_bps == 8e12
    with pytest.raises(ValueError, match="--gpu must be one of"):
        hardware("tpu")


@pytest.mark.slow  # ~10 s: two spawned processes (gloo pair, hybridrl's model on one rank)
def test_forward_budget_flag(capsys):
    """--forward-tokens-per-gpu sets the forward passes' micro-batches; negative is one line."""
    base = ["--model", "llama-3.2-1b", "--world", "2", "--tp", "2", "--gen-tp", "2",
            "--prompts", "64",
            "--prompt-len", "100", "--max-response-len", "28", "--max-tokens-per-gpu", "512",
            "--gpu-gb", "1000"]
    same = _time(base, capsys)
    small = _time([*base, "--forward-tokens-per-gpu", "128"], capsys)
    # one 128-token sequence per forward micro-batch instead of four: 4x the TP collectives
    assert small["phases_s"]["old_log_prob"] > same["phases_s"]["old_log_prob"]
    assert small["phases_s"]["actor_update"] == same["phases_s"]["actor_update"]
    assert main(["--time", *base, "--forward-tokens-per-gpu", "-5"]) == 2
    assert "--forward-tokens-per-gpu must be >= 0" in capsys.readouterr().err


def test_calibration_fit_by_hand():
    """The model's terms from its timings: the forward and the training pass are straight
    lines in their tokens (2 and 8 sequences of 72 tokens)."""
    from hybridrl.planning.calibrate import SEQ_LEN, SEQS, fit_model

    assert SEQS == (2, 8) and SEQ_LEN == 72
    shape = LlamaShape(hidden=64, ffn=128, heads=4, num_query_groups=2, layers=4, vocab=100)
    flops, bps = 1e11, 5e9
    tok = F.forward_flops(shape, 72) / 72 / flops  # a token's FLOPs in seconds
    calls, extra = 2e-3, 5e-6  # 4 layers + the head: 400 us a call; 5 us a token beyond
    t_calls, t_extra = 5e-3, 12e-6  # training: 2.5 x the calls, 2.4 x the traffic

    def fwd(n):
        return calls + n * 72 * (tok + extra)

    def train(n):
        return t_calls + n * 72 * (3 * tok + t_extra)
    r = {"fwd2": fwd(2), "fwd8": fwd(8), "train2": train(2), "train8": train(8),
         "step": train(8) + 1e-3 + 1000 * OPTIMIZER_BYTES_PER_PARAM / bps, "params": 1000,
         "layers": 4, "hidden": 64, "ffn": 128, "heads": 4, "groups": 2, "vocab": 100}
    fit = fit_model(r, flops, bps)
    assert fit["layer_latency_s"] == pytest.approx(calls / 5)
    assert fit["train_calls_per_forward"] == pytest.approx(2.5)
    # 5 us per token at 5 GB/s is 25 kB: fp32 vectors of 4 x 64 + 100 = 356 floats
    assert fit["act_passes"] == pytest.approx(extra * bps / ((4 * 64 + 100) * 4))
    assert fit["train_act_ratio"] == pytest.approx(2.4)
    assert fit["optimizer_latency_s"] == pytest.approx(1e-3)
    # the tp-2 forward of 8 sequences: the layer calls, half the FLOPs, the activation
    # traffic, and 2 x 4 + 5 collectives of 300 us each
    from hybridrl.planning.calibrate import tp_collective_s

    compute = calls + 8 * 72 * (tok / 2 + extra)
    assert tp_collective_s(r, fit, compute + 13 * 3e-4, flops, bps) == pytest.approx(3e-4)


def test_calibration_measures_this_machine(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["--calibrate", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    from hybridrl.planning.calibrate import KEYS, cache_path, load_calibration

    assert rep["path"] == cache_path() and rep["path"].startswith(str(tmp_path))
    cached = load_calibration()
    assert all(cached[k] > 0 for k in KEYS)
    # megatron's modules cost more per layer call than the same layer's bare torch ops, and a
    # training pass more than a forward
    assert cached["layer_latency_s"] > cached["torch_layer_latency_s"]
    assert cached["train_calls_per_forward"] > 1
    # beyond the GEMMs every token moves activations; a run's collective waits at least as
    # long as the best one; the cores this process may use
    assert cached["act_passes"] > 0 and cached["train_act_ratio"] > 0
    assert cached["collective_latency_s"] >= cached["collective_min_s"] > 0
    assert cached["collective_bench_s"] >= cached["collective_min_s"]
    assert cached["cores"] >= 1 and cached["parallel_slowdown"] >= 1
    assert cached["dp_step_latency_s"] >= 0
    rep = _time(["--model", "llama-3.2-1b", "--gpu", "cpu", "--world", "1", "--gen-tp", "1",
                 "--spec", "local", "--engine", "builtin", "--dtype", "fp32", "--prompts", "2",
                 "--prompt-len", "16", "--max-response-len", "8"], capsys)
    assert rep["gpu"] == "cpu" and rep["step_s"] > 0
