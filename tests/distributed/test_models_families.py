"""Llama 3.x, Qwen3 and Qwen2.5 (+ yarn) at (tp, pp, dp) = (2, 2, 1) on gloo vs transformers.

Each family is a scaled-down copy of a real config.json that keeps its distinguishing keys:
- llama3: Llama-3.1-8B's keys, ``rope_scaling`` llama3 with factor 8, low/high 1/4 and a
  non-default ``original_max_position_embeddings`` (64, not 8192), untied;
- llama3_tied: Llama-3.2-1B's keys (tied, factor 32) with low/high 2/8 and original 48;
- qwen3: Qwen3-8B's keys (per-head q/k norm, ``head_dim`` 32 while hidden/heads = 16), untied;
- qwen3_tied: Qwen3-0.6B's keys (tied);
- qwen25_yarn: Qwen2.5-7B-Instruct's keys (q/k/v bias, sliding_window set but unused) plus the
  model card's yarn ``rope_scaling`` (factor 4, original 16).
All cases run in ONE launch of 4 gloo ranks; three families also at dp = 2 ((1,2,2), (2,1,2)). Checked in the parent, per family:
- actor and frozen reference log-probs and entropy equal transformers' (fp32, 1e-4; ~1e-6 seen);
  the scaled RoPE matters: transformers without the scaling differs by > 20x that (8e-3 for
  llama3 at these 12 positions);
- critic values = transformers' final hidden state @ the critic's head;
- the builtin engine fed by the reshard (gen tp 2): its prefill log-probs equal the actor's,
  and the log-probs of its sampled responses equal transformers' recompute;
- export -> reload is exact, and transformers loads the export with the same log-probs;
- a trainer checkpoint (``Checkpointer``) of three families through ``hybridrl export``:
  transformers gives the source's log-probs.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from hybridrl.models.vocab_parallel import reference_logprobs_entropy
from hybridrl.testing.dist import run_on_ranks
from tests.distributed import test_models_cases as cases_mod
from tests.distributed import test_models_families_cases as fam_cases

VOCAB, SEQ, N_SEQS, N_MICRO = 100, 12, 4, 2
TOL = 1e-4
SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB)

FAMILIES = {
    "llama3": {  # meta-llama/Llama-3.1-8B-Instruct, scaled down
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "initializer_range": 0.02,
        "max_position_embeddings": 1024, "mlp_bias": False, "model_type": "llama",
        "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
        "use_cache": True, **SIZES},
    "llama3_tied": {  # meta-llama/Llama-3.2-1B, scaled down
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "head_dim": 16, "hidden_act": "silu",
        "initializer_range": 0.02, "max_position_embeddings": 1024, "mlp_bias": False,
        "model_type": "llama", "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                         "original_max_position_embeddings": 48, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "float32",
        "use_cache": True, **SIZES},
    "qwen3": {  # Qwen/Qwen3-8B, scaled down
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "head_dim": 32, "hidden_act": "silu",
        "initializer_range": 0.02, "max_position_embeddings": 256, "max_window_layers": 4,
        "model_type": "qwen3", "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "float32", "use_cache": True, "use_sliding_window": False, **SIZES},
    "qwen3_tied": {  # Qwen/Qwen3-0.6B, scaled down
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "head_dim": 32, "hidden_act": "silu",
        "initializer_range": 0.02, "max_position_embeddings": 256, "max_window_layers": 4,
        "model_type": "qwen3", "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
        "torch_dtype": "float32", "use_cache": True, "use_sliding_window": False, **SIZES},
    "qwen25_yarn": {  # Qwen/Qwen2.5-7B-Instruct + the model card's yarn, scaled down
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "initializer_range": 0.02,
        "max_position_embeddings": 64, "max_window_layers": 4, "model_type": "qwen2",
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 64,
        "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 16, "type": "yarn"},
        "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True,
        "use_sliding_window": False, **SIZES},
}


CHECKPOINTED = ("llama3", "qwen3_tied", "qwen25_yarn")  # through `hybridrl export` too
OTHER_LAYOUTS = {"llama3_tied": (1, 2), "qwen3": (2, 1), "qwen25_yarn": (1, 2)}  # (tp, pp), dp 2


def save_family(folder: str, config: dict, seed: int, noise: float = 0.05) -> str:
    """Random weights for ``config`` (the default init plus ``noise`` x a normal draw) saved with
    save_pretrained; config.json is then the scaled-down real one exactly as given
    (transformers 4.x style keys)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    with torch.no_grad():  # larger than the default init, so differences show
        for p in model.parameters():
            p.add_(noise * torch.randn_like(p))
    model.save_pretrained(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def hf_model(folder, plain_rope: bool = False):
    """transformers' model of ``folder`` (``plain_rope``: with its RoPE scaling removed)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    if plain_rope:
        cfg.rope_parameters = {"rope_type": "default",
                               "rope_theta": cfg.rope_parameters["rope_theta"]}
    return AutoModelForCausalLM.from_pretrained(folder, config=cfg, attn_implementation="eager",
                                                dtype=torch.float32).eval()


def hf_logprobs(model, input_ids):
    from hybridrl.models.forward import next_token_labels

    ids = torch.as_tensor(input_ids)
    with torch.no_grad():
        logits = model(ids).logits
    logp, ent = reference_logprobs_entropy(logits, next_token_labels(ids))
    return logp.numpy(), ent.numpy()


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    folders = {name: save_family(str(root / name), cfg, seed)
               for seed, (name, cfg) in enumerate(FAMILIES.items())}
    batch = cases_mod.make_batch(0, N_SEQS, SEQ, VOCAB)
    common = dict(tp=2, pp=2, batch=batch, n_micro=N_MICRO)
    cases, index = [], {}
    for name, folder in folders.items():
        for kind, extra in (("logprobs", {}), ("logprobs", {"role": "reference"}),
                            ("critic_values", {}), ("engine", {"gen_tp": 2}),
                            ("roundtrip", {"out": str(root / f"{name}_export")})):
            index[(name, kind, extra.get("role", ""))] = len(cases)
            cases.append(dict(kind=kind, folder=folder, **common, **extra))
    for name in CHECKPOINTED:
        index[(name, "checkpoint", "")] = len(cases)
        cases.append(dict(kind="checkpoint", folder=folders[name], out=str(root / f"{name}_ck"),
                          **common))
    for name, (tp, pp) in OTHER_LAYOUTS.items():  # dp = 2
        index[(name, "logprobs", f"{tp}{pp}2")] = len(cases)
        cases.append(dict(kind="logprobs", folder=folders[name], tp=tp, pp=pp, batch=batch,
                          n_micro=1))
    res = run_on_ranks(fam_cases.run_cases, 4, cases, timeout=900, preload=("megatron.core",))
    return dict(root=root, folders=folders, batch=batch, res=res, index=index)


def _assemble(suite, name, key):
    """Log-probs of a dp = 2 case: the last-stage, tp_rank 0 result of each DP rank in order."""
    i = suite["index"][(name, "logprobs", key)]
    parts = sorted((r[i]["dp_rank"], r[i]["logprobs"]) for r in suite["res"] if r[i])
    return np.concatenate([p for _, p in parts])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OTHER_LAYOUTS))
def test_family_other_layouts(suite, name):
    ref_logp, _ = hf_logprobs(hf_model(suite["folders"][name]), suite["batch"]["input_ids"])
    tp, pp = OTHER_LAYOUTS[name]
    got = _assemble(suite, name, f"{tp}{pp}2")
    print(f"{name}: max |dlogprob| vs transformers at ({tp},{pp},2): "
          f"{np.abs(got - ref_logp).max():.1e}")
    np.testing.assert_allclose(got, ref_logp, atol=TOL, rtol=0)


def _last_stage(suite, name, kind, role=""):
    i = suite["index"][(name, kind, role)]
    return next(r[i] for r in suite["res"] if r[i])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers(suite, name):
    folder, ids = suite["folders"][name], suite["batch"]["input_ids"]
    model = hf_model(folder)
    ref_logp, ref_ent = hf_logprobs(model, ids)
    figures = {}
    for role in ("", "reference"):
        got = _last_stage(suite, name, "logprobs", role)
        figures[role or "actor"] = float(np.abs(got["logprobs"] - ref_logp).max())
        np.testing.assert_allclose(got["logprobs"], ref_logp, atol=TOL, rtol=0)
        np.testing.assert_allclose(got["entropy"], ref_ent, atol=TOL, rtol=0)
    # the scaling is really exercised: without it transformers gives other numbers
    if FAMILIES[name].get("rope_scaling"):
        plain, _ = hf_logprobs(hf_model(folder, plain_rope=True), ids)
        assert np.abs(plain - ref_logp).max() > 20 * TOL
    # critic: values = final hidden state (after the final norm) @ head
    crit = _last_stage(suite, name, "critic_values")
    with torch.no_grad():
        hidden = model.model(torch.as_tensor(ids)).last_hidden_state
    want = (hidden @ torch.as_tensor(crit["head"]).T)[..., 0].numpy()
    np.testing.assert_allclose(crit["values"], want, atol=TOL, rtol=0)
    print(f"{name}: max |dlogprob| vs transformers at (2,2,1): {figures}")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_builtin_engine_after_reshard(suite, name):
    ids = suite["batch"]["input_ids"]
    eng = _last_stage(suite, name, "engine")
    actor = _last_stage(suite, name, "logprobs")
    diff = np.abs(eng["engine_logprobs"] - actor["logprobs"][:, :-1]).max()
    print(f"{name}: builtin engine (gen tp 2) vs actor (2,2,1): max |dlogprob| {diff:.1e}")
    assert diff <= TOL, diff
    model = hf_model(suite["folders"][name])
    for b, prompt in enumerate(eng["prompts"]):
        n = int(eng["response_mask"][b].sum())
        full = torch.tensor([prompt + list(map(int, eng["responses"][b, :n]))])
        with torch.no_grad():
            logp = torch.log_softmax(model(full).logits[0].float(), -1)
        want = logp[len(prompt) - 1:-1].gather(-1, full[0, len(prompt):, None])[:, 0]
        np.testing.assert_allclose(eng["response_logprobs"][b, :n], want.numpy(), atol=TOL)
    assert ids.shape[0] == N_SEQS


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_export_reloads_and_transformers_agrees(suite, name):
    assert _last_stage(suite, name, "roundtrip")["exact"]
    out = str(suite["root"] / f"{name}_export")
    ids = suite["batch"]["input_ids"]
    want, _ = hf_logprobs(hf_model(suite["folders"][name]), ids)
    got, _ = hf_logprobs(hf_model(out), ids)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    exported = json.load(open(os.path.join(out, "config.json")))
    assert exported["architectures"] == FAMILIES[name]["architectures"]
    assert exported.get("head_dim") == FAMILIES[name].get("head_dim", 16)


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKPOINTED)
def test_hybridrl_export_of_a_checkpoint(suite, tmp_path, name):
    """A trainer checkpoint at (2,2,1) -> ``hybridrl export`` -> transformers: same log-probs."""
    from hybridrl.cli import main

    ckpt = _last_stage(suite, name, "checkpoint")["folder"]
    assert main(["export", ckpt, "--role", "actor", "--out", str(tmp_path / "hf")]) == 0
    ids = suite["batch"]["input_ids"]
    want, _ = hf_logprobs(hf_model(suite["folders"][name]), ids)
    got, _ = hf_logprobs(hf_model(str(tmp_path / "hf")), ids)
    print(f"{name}: hybridrl export vs source, transformers max |dlogprob| "
          f"{np.abs(got - want).max():.1e}")
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
