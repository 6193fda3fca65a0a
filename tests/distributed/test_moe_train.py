"""Qwen3-MoE training side (issue 38 item 2) on gloo ranks vs transformers' Qwen3MoeForCausalLM.

One launch of 4 ranks runs every case; the parent checks, on a scaled-down Qwen3-30B-A3B-style
config (8 experts, top-2, q/k norm, per-head RMSNorm, no shared expert):
- log-probs at (t, p, ep) = (1,1,1), (1,1,2), (2,1,2), (1,2,2) equal transformers' (fp32, 1e-5);
- one optimizer step (clip + AdamW) at each layout, exported to the HF layout (per-expert
  ``mlp.experts.e.{gate,up,down}_proj``, ``mlp.gate``), equals transformers' step on the same
  loss (the single-process oracle) within 1e-5, and the grad norm agrees: expert gradients are
  averaged over the expert-dp group, dense ones over dp;
- with ``output_router_logits`` and ``router_aux_loss_coef`` the aux (load-balancing) loss
  changes the router's step, identically at (1,1,1) and (2,1,2);
- the memory plan's parameter count of a rank (``stage_numel`` with ep / etp) is what the
  model allocates, and its optimizer bytes (dense / dp + experts / edp) what megatron's
  distributed optimizer holds (within 3 %: its bucket padding and per-rank remainders);
- the builtin tiny MoE of configs/demo_moe.yaml (no HF folder) at ep 2 is a Qwen3-MoE that
  transformers loads (from its export) with the same log-probs, and it trains a step.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from hybridrl.models.vocab_parallel import reference_logprobs_entropy
from hybridrl.testing.dist import run_on_ranks
from tests.distributed import test_models_cases as base
from tests.distributed import test_moe_train_cases as moe_cases
from tests.distributed.test_models_families import save_family

VOCAB, SEQ, N_SEQS = 100, 10, 8
TOL = 1e-5
LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)]  # (tp, pp, ep) on 4 ranks
QWEN3_MOE = {  # Qwen/Qwen3-30B-A3B's config.json keys, scaled down
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 1, "decoder_sparse_step": 1, "eos_token_id": 2, "head_dim": 16,
    "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02,
    "intermediate_size": 96, "max_position_embeddings": 256, "max_window_layers": 2,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 16,
    "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 8,
    "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True,
    "use_sliding_window": False, "vocab_size": VOCAB,
}


def _save(folder: str, config: dict, seed: int) -> str:
    """The HF folder of ``config`` (test_models_families.save_family, a larger weight noise so
    that differences show)."""
    return save_family(folder, config, seed, noise=0.1)


def _hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                dtype=torch.float32).eval()


def _read(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(__import__("pathlib").Path(folder).glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _hf_train_step(folder, batch, out):
    """The single-process oracle: transformers forward, same loss, clip and AdamW, saved."""
    from hybridrl.models.forward import next_token_labels

    model = _hf_model(folder)
    model.train()
    mbs = base.split_microbatches(batch, 1, 0, 4)  # the cuts every layout makes
    total = 0.0
    for mb in mbs:
        logits = model(mb["input_ids"]).logits
        logp, ent = reference_logprobs_entropy(logits, next_token_labels(mb["input_ids"]))
        loss, _ = base.actor_loss({"logprobs": logp, "entropy": ent}, mb)
        total = total + loss / len(mbs)
    total.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params))
    if norm > base.GRAD_CLIP:
        for p in params:
            p.grad.mul_(base.GRAD_CLIP / (norm + 1e-6))
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim > 1],
                              "weight_decay": base.WEIGHT_DECAY},
                             {"params": [p for p in params if p.ndim <= 1],
                              "weight_decay": 0.0}], lr=base.LR)
    opt.step()
    model.save_pretrained(out)
    return _read(out), norm


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    plain = _save(str(root / "plain"), QWEN3_MOE, 0)
    aux = _save(str(root / "aux"), {**QWEN3_MOE, "output_router_logits": True,
                                    "router_aux_loss_coef": 0.5}, 0)
    batch = base.make_batch(3, N_SEQS, SEQ, VOCAB)
    cases, index = [], {}
    for tp, pp, ep in LAYOUTS:
        index[("groups", tp, pp, ep)] = len(cases)
        cases.append(dict(kind="groups", tp=tp, pp=pp, ep=ep))
        n_micro = 4 // (4 // (tp * pp))  # 4 micro-batches of 2 rows over all DP ranks
        common = dict(tp=tp, pp=pp, ep=ep, batch=batch, n_micro=n_micro)
        index[("logprobs", tp, pp, ep)] = len(cases)
        cases.append(dict(kind="logprobs", folder=plain, **common))
        index[("train", tp, pp, ep)] = len(cases)
        cases.append(dict(kind="train", folder=plain, out=str(root / f"step{tp}{pp}{ep}"),
                          **common))
        if (tp, pp, ep) in ((1, 1, 1), (2, 1, 2)):
            index[("aux", tp, pp, ep)] = len(cases)
            cases.append(dict(kind="train", folder=aux, out=str(root / f"aux{tp}{pp}{ep}"),
                              **common))
    demo = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "demo_moe.yaml")
    index["builtin"] = len(cases)
    cases.append(dict(kind="builtin", tp=1, pp=1, ep=2, config=[demo], out=str(root / "demo"),
                      batch=batch, n_micro=1))
    res = run_on_ranks(moe_cases.run_cases, 4, cases, timeout=600, preload=("megatron.core",))
    return dict(root=root, plain=plain, aux=aux, batch=batch, res=res, index=index)


def _results(suite, *key):
    if key == ("builtin",):
        return [r[suite["index"]["builtin"]] for r in suite["res"]]
    i = suite["index"][key]
    return [r[i] for r in suite["res"]]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_groups_are_megatrons_on_real_ranks(suite, layout):
    from hybridrl.parallel.layout import TrainLayout

    tp, pp, ep = layout
    train = TrainLayout(world=4, tp=tp, pp=pp, ep=ep)
    for r in _results(suite, "groups", *layout):
        c = train.expert_coords(r["rank"])
        assert r["megatron"] == (c["ep"], c["tp"], c["dp"], [ep])
        assert all(got == want for got, want in r["sums"].values())
        assert r["members"]["ep"] in train.expert_groups("ep")
        assert r["members"]["expt_dp"] in train.expert_groups("dp")


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_logprobs_match_transformers(suite, layout):
    from hybridrl.models.forward import next_token_labels

    ids = torch.as_tensor(suite["batch"]["input_ids"])
    with torch.no_grad():
        ref, _ = reference_logprobs_entropy(_hf_model(suite["plain"])(ids).logits,
                                            next_token_labels(ids))
    parts = sorted((r["dp_rank"], r["logprobs"]) for r in _results(suite, "logprobs", *layout)
                   if r)
    got = np.concatenate([p for _, p in parts])
    print(f"{layout}: max |dlogprob| vs transformers {np.abs(got - ref.numpy()).max():.1e}")
    np.testing.assert_allclose(got, ref.numpy(), atol=TOL, rtol=0)


@pytest.mark.slow
def test_moe_optimizer_step_equals_transformers_at_every_layout(suite, tmp_path):
    ref, ref_norm = _hf_train_step(suite["plain"], suite["batch"], tmp_path / "oracle")
    source = _read(suite["plain"])
    assert any(".mlp.experts.7.down_proj." in k for k in source)  # per-expert names on disk
    for layout in LAYOUTS:
        got = _read(suite["root"] / "step{}{}{}".format(*layout))
        assert set(got) == set(ref) == set(source), layout
        moved = 0.0
        for name, tensor in got.items():
            torch.testing.assert_close(tensor, ref[name], atol=TOL, rtol=0,
                                       msg=f"{layout} {name}")
            moved = max(moved, float((tensor - source[name]).abs().max()))
        assert moved > 100 * TOL  # the step really changed the weights
        metrics = _results(suite, "train", *layout)[0]["metrics"]
        assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-5), layout
    assert ref_norm > base.GRAD_CLIP  # clipping was exercised


@pytest.mark.slow
def test_moe_aux_loss_trains_the_router_alike_at_two_layouts(suite):
    plain = _read(suite["root"] / "step111")
    one, two = _read(suite["root"] / "aux111"), _read(suite["root"] / "aux212")
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=TOL, rtol=0, msg=name)
    router = "model.layers.0.mlp.gate.weight"
    assert float((one[router] - plain[router]).abs().max()) > 100 * TOL  # aux loss acted


@pytest.mark.slow
def test_builtin_moe_preset_is_a_qwen3_moe_transformers_loads(suite):
    from hybridrl.models.forward import next_token_labels

    folder = suite["root"] / "demo"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"]) == (8, 2)
    ids = torch.as_tensor(suite["batch"]["input_ids"])
    with torch.no_grad():
        ref, _ = reference_logprobs_entropy(_hf_model(folder)(ids).logits, next_token_labels(ids))
    results = [r for r in _results(suite, "builtin") if r]
    got = np.concatenate([r["logprobs"] for r in sorted(results, key=lambda r: r["dp_rank"])])
    np.testing.assert_allclose(got, ref.numpy(), atol=TOL, rtol=0)
    assert all(math.isfinite(r["metrics"]["grad_norm"]) and r["metrics"]["grad_norm"] > 0
               for r in results)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_memory_plan_counts_what_the_moe_model_allocates(suite, layout):
    from hybridrl.planning.memory import MemoryJob, model_state_bytes, stage_numel
    from hybridrl.reshard.specs import LlamaShape

    tp, pp, ep = layout
    shape = LlamaShape.from_hf_config(QWEN3_MOE)
    job = MemoryJob(shape=shape, world=4, tp=tp, pp=pp, ep=ep, dtype="fp32", seq_len=SEQ,
                    max_tokens_per_gpu=SEQ, sequence_parallel=tp > 1)
    for r in _results(suite, "train", *layout):
        assert r["numel"] == stage_numel(shape, tp, pp, r["pp_rank"], ep=ep, etp=tp)
        want = model_state_bytes(job, "actor", r["pp_rank"])["optim"]
        # megatron pads and splits its buckets per rank: equal up to a small remainder
        assert r["state_bytes"] == pytest.approx(want, rel=0.03), (layout, want, r)
