"""megatron-core actor/critic on gloo ranks vs transformers' LlamaForCausalLM on the same weights.

Four rank groups (world 8, 4, 2 and 1) run every case of their world in ONE run_on_ranks call:
(tp, pp, dp) = (2,2,2), (1,2,4), (2,1,4), tied (2,2,2); (2,2,1); (2,1,1), (1,2,1); (1,1,1). Checked here, in the
parent process, against the single-process transformers model:
- per-token log-probs (fp32, atol 1e-5) and entropy (a full-vocab softmax reference);
- one optimizer step (PPO-shaped loss with an entropy bonus, clipping active) at (2,2,2) and at
  (1,1,1): the exported parameters equal each other and the transformers + torch AdamW step;
  also for Qwen3 (q/k norm gradients summed over TP);
  megatron's distributed optimizer (the default) and its plain optimizer give the same step, each
  DP rank holds 1/dp of the optimizer state, and a save/load of the optimizer resumes bit-exactly;
- critic values at (2,2,2) = final hidden state @ head, gradients reach every parameter;
- export -> reload is exact, and the export equals the source checkpoint tensor for tensor.
The tiny model has GQA (4 heads, 2 groups), untied embeddings and vocab 100 (padded to 256 at
tp=2, so the second TP rank holds only padding rows of the vocabulary).
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
from tests.distributed import test_models_cases as cases_mod

VOCAB, SEQ, N_SEQS, N_MICRO = 100, 12, 16, 2
TOL = 1e-5


def _save_tiny(folder, *, tie: bool, arch: str = "llama", seed: int = 0):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    kwargs = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  max_position_embeddings=64, tie_word_embeddings=tie, rms_norm_eps=1e-5)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kwargs))
    elif arch == "qwen3":  # per-head q/k norms [head_dim], replicated on every TP rank
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kwargs))
    else:
        model = LlamaForCausalLM(LlamaConfig(**kwargs))
    with torch.no_grad():  # larger than the default init, so the test sees real differences
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def _without_lm_head(folder, out):
    """A copy of an untied checkpoint whose safetensors lack lm_head.weight."""
    import glob
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    for path in glob.glob(os.path.join(out, "*.safetensors")):
        tensors = load_file(path)
        tensors.pop("lm_head.weight", None)
        save_file(tensors, path, metadata={"format": "pt"})
    return out


def _hf_model(folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                 dtype=torch.float32)
    return model.eval()


def _hf_logprobs(model, input_ids):
    from hybridrl.models.forward import next_token_labels

    ids = torch.as_tensor(input_ids)
    logits = model(ids).logits
    return reference_logprobs_entropy(logits, next_token_labels(ids))


def _hf_train_step(folder, batch):
    """The (1,1,1) oracle: transformers forward, same loss, clip and AdamW."""
    model = _hf_model(folder)
    model.train()
    mbs = cases_mod.split_microbatches(batch, 1, 0, N_MICRO * 2)  # all DP shares, same cuts
    from hybridrl.models.forward import next_token_labels

    total = 0.0
    for mb in mbs:
        logits = model(mb["input_ids"]).logits
        logp, ent = reference_logprobs_entropy(logits, next_token_labels(mb["input_ids"]))
        loss, _ = cases_mod.actor_loss({"logprobs": logp, "entropy": ent}, mb)
        total = total + loss / len(mbs)
    total.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params))
    if norm > cases_mod.GRAD_CLIP:
        for p in params:
            p.grad.mul_(cases_mod.GRAD_CLIP / (norm + 1e-6))
    decay = [p for p in params if p.ndim > 1]
    rest = [p for p in params if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cases_mod.WEIGHT_DECAY},
                             {"params": rest, "weight_decay": 0.0}], lr=cases_mod.LR)
    opt.step()
    return {n: p.detach() for n, p in model.state_dict().items()}, norm


def _read_folder(folder):
    from safetensors.torch import load_file

    out = {}
    for path in sorted(__import__("pathlib").Path(folder).glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _assemble(results, key, dp_size):
    """Concatenate the last-stage, tp_rank 0 results of every DP rank in DP order."""
    parts = sorted((r["dp_rank"], r[key]) for r in results if r)
    assert [d for d, _ in parts] == list(range(dp_size))
    return np.concatenate([p for _, p in parts])


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    untied = _save_tiny(str(root / "untied"), tie=False)
    tied = _save_tiny(str(root / "tied"), tie=True, seed=1)
    qwen2 = _save_tiny(str(root / "qwen2"), tie=False, arch="qwen2", seed=2)
    qwen3 = _save_tiny(str(root / "qwen3"), tie=False, arch="qwen3", seed=3)
    batch = cases_mod.make_batch(0, N_SEQS, SEQ, VOCAB)
    common = dict(batch=batch, n_micro=N_MICRO)
    w8 = [
        dict(kind="logprobs", tp=2, pp=2, folder=untied, **common),
        dict(kind="logprobs", tp=1, pp=2, folder=untied, **common),
        dict(kind="logprobs", tp=2, pp=1, folder=untied, **common),
        dict(kind="logprobs", tp=2, pp=2, folder=tied, **common),
        dict(kind="train", tp=2, pp=2, folder=untied, out=str(root / "step222"), **common),
        dict(kind="critic_values", tp=2, pp=2, folder=untied, **common),
        dict(kind="train", tp=2, pp=2, folder=untied, role="critic", out=str(root / "crit"),
             **common),
        dict(kind="roundtrip", tp=2, pp=2, folder=untied, out=str(root / "rt_untied")),
        dict(kind="roundtrip", tp=2, pp=2, folder=tied, out=str(root / "rt_tied")),
        dict(kind="train", tp=2, pp=2, folder=tied, out=str(root / "step222_tied"), **common),
        dict(kind="logprobs", tp=2, pp=2, folder=qwen2, **common),
        dict(kind="roundtrip", tp=2, pp=1, folder=qwen2, out=str(root / "rt_qwen2")),
        dict(kind="train", tp=2, pp=2, folder=untied, out=str(root / "step222_plain"),
             distributed=False, **common),  # 12: megatron's non-distributed optimizer
        dict(kind="train", tp=2, pp=2, folder=untied, out=str(root / "step222_bf16"),
             dtype="bf16", **common),  # 13: bf16 with sharded fp32 masters
        dict(kind="train", tp=2, pp=2, folder=untied, out=str(root / "step222_overlap"),
             overlap=True, **common),  # 14: overlapped grad reduce-scatter and param gather
        dict(kind="nonfinite", tp=2, pp=2, folder=untied, **common),  # 15
        dict(kind="train", tp=2, pp=2, folder=qwen3, out=str(root / "step222_qwen3"),
             **common),  # 16: q/k norm gradients summed over TP
    ]
    w4 = [dict(kind="logprobs", tp=2, pp=2, folder=untied, **common),
          dict(kind="logprobs", tp=2, pp=2, folder=untied, role="reference", **common)]
    w2 = [dict(kind="logprobs", tp=2, pp=1, folder=untied, **common),  # (2, 1, 1)
          dict(kind="logprobs", tp=1, pp=2, folder=untied, **common)]  # (1, 2, 1)
    w1 = [
        dict(kind="logprobs", tp=1, pp=1, folder=untied, **common),
        dict(kind="train", tp=1, pp=1, folder=untied, out=str(root / "step111"), batch=batch,
             n_micro=N_MICRO * 2),
        dict(kind="train", tp=1, pp=1, folder=untied, out=str(root / "step111_bf16"),
             batch=batch, n_micro=N_MICRO * 2, dtype="bf16"),
        dict(kind="builtin", tp=1, pp=1),
        dict(kind="load_error", tp=1, pp=1, folder=_without_lm_head(untied, str(root / "no_head"))),
        dict(kind="train", tp=1, pp=1, folder=qwen3, out=str(root / "step111_qwen3"),
             batch=batch, n_micro=N_MICRO * 2),  # 5
    ]
    res = {8: run_on_ranks(cases_mod.run_cases, 8, w8, timeout=400, preload=("megatron.core",)),
           4: run_on_ranks(cases_mod.run_cases, 4, w4, timeout=200, preload=("megatron.core",)),
           2: run_on_ranks(cases_mod.run_cases, 2, w2, timeout=200, preload=("megatron.core",)),
           1: run_on_ranks(cases_mod.run_cases, 1, w1, timeout=200, preload=("megatron.core",))}
    return dict(root=root, untied=untied, tied=tied, qwen2=qwen2, qwen3=qwen3, batch=batch,
                cases={8: w8, 4: w4, 2: w2, 1: w1}, res=res)


def _case_results(suite, world, index):
    return [rank_results[index] for rank_results in suite["res"][world]]


LOGPROB_CASES = [(8, 0, 2, "untied"), (8, 1, 4, "untied"), (8, 2, 4, "untied"),
                 (8, 3, 2, "tied"), (8, 10, 2, "qwen2"), (4, 0, 1, "untied"),
                 (4, 1, 1, "untied"), (2, 0, 1, "untied"), (2, 1, 1, "untied"),
                 (1, 0, 1, "untied")]  # (4, 1): the frozen reference


@pytest.mark.slow
@pytest.mark.parametrize("world,index,dp,which", LOGPROB_CASES)
def test_logprobs_and_entropy_match_transformers(suite, world, index, dp, which):
    ref_logp, ref_ent = _hf_logprobs(_hf_model(suite[which]), suite["batch"]["input_ids"])
    results = _case_results(suite, world, index)
    logp = _assemble(results, "logprobs", dp)
    ent = _assemble(results, "entropy", dp)
    np.testing.assert_allclose(logp, ref_logp.detach().numpy(), atol=TOL, rtol=0)
    np.testing.assert_allclose(ent, ref_ent.detach().numpy(), atol=TOL, rtol=0)


@pytest.mark.slow
def test_optimizer_step_222_equals_111_and_transformers(suite):
    ref, ref_norm = _hf_train_step(suite["untied"], suite["batch"])
    step222 = _read_folder(suite["root"] / "step222")
    step111 = _read_folder(suite["root"] / "step111")
    source = _read_folder(suite["untied"])
    assert set(step222) == set(step111) == set(source)
    moved = 0.0
    for name, tensor in step222.items():
        torch.testing.assert_close(tensor, step111[name], atol=TOL, rtol=0, msg=name)
        torch.testing.assert_close(tensor, ref[name], atol=TOL, rtol=0, msg=name)
        moved = max(moved, float((tensor - source[name]).abs().max()))
    assert moved > 100 * TOL  # the step really changed the weights
    metrics222 = _case_results(suite, 8, 4)[0]["metrics"]
    metrics111 = _case_results(suite, 1, 1)[0]["metrics"]
    assert metrics222["grad_norm"] > cases_mod.GRAD_CLIP  # clipping was exercised
    assert metrics222["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    assert metrics111["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    assert metrics222["loss"] == pytest.approx(metrics111["loss"], abs=1e-6)
    assert all(r["metrics"] == metrics222 for r in _case_results(suite, 8, 4))


@pytest.mark.slow
def test_optimizer_step_222_equals_111_qwen3_qk_norms(suite):
    """Qwen3 at tp 2: each TP rank's q_layernorm / k_layernorm gradient covers only its own
    heads, so megatron's finalize_model_grads must sum it over TP (by parameter name); the
    updated norms equal the 1-rank step and transformers' (1e-5; without the TP sum they differ
    by 2e-3, the grad norm by 4e-5 relative). Other tensors: 1e-4 (Adam's first update
    lr·g/(|g| + eps) amplifies summation-order rounding where a gradient is near 0; 2e-5 seen
    on the embedding at (2,1,1))."""
    step222 = _read_folder(suite["root"] / "step222_qwen3")
    step111 = _read_folder(suite["root"] / "step111_qwen3")
    source = _read_folder(suite["qwen3"])
    ref, ref_norm = _hf_train_step(suite["qwen3"], suite["batch"])
    norms = [n for n in step222 if n.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight"))]
    assert len(norms) == 8 and set(step222) == set(step111) == set(source)
    for name, tensor in step222.items():
        tol = TOL if name in norms else 10 * TOL
        torch.testing.assert_close(tensor, step111[name], atol=tol, rtol=0, msg=name)
        torch.testing.assert_close(tensor, ref[name], atol=tol, rtol=0, msg=name)
    assert min(float((step222[n] - source[n]).abs().max()) for n in norms) > 50 * TOL  # ~lr
    m222, m111 = _case_results(suite, 8, 16)[0]["metrics"], _case_results(suite, 1, 5)[0]["metrics"]
    assert m222["grad_norm"] == pytest.approx(m111["grad_norm"], rel=1e-5)
    assert m222["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)


def _by_stage(results):
    stages = {}
    for r in results:
        stages.setdefault((r["tp_rank"], r["pp_rank"]), []).append(r)
    return stages


@pytest.mark.slow
def test_distributed_optimizer_shards_state_over_dp(suite):
    """(2,2,2): every DP rank of a (tp, pp) stage holds a disjoint half of its fp32 main
    parameters and Adam moments; the plain optimizer holds all of them on every rank."""
    sharded, plain = _case_results(suite, 8, 4), _case_results(suite, 8, 12)
    bf16 = _case_results(suite, 8, 13)
    for stage, ranks in _by_stage(sharded).items():
        (full,) = [r for r in plain if (r["tp_rank"], r["pp_rank"]) == stage and r["dp_rank"] == 0]
        assert full["main_numel"] == full["stage_numel"]
        assert sum(r["main_numel"] for r in ranks) == full["stage_numel"]
        assert sum(r["state_bytes"] for r in ranks) == full["state_bytes"]
        for r in ranks:  # each rank: about half (megatron pads buckets to the DP size)
            assert abs(r["state_bytes"] - full["state_bytes"] / 2) <= 0.02 * full["state_bytes"]
    for ranks in _by_stage(bf16).values():  # bf16: fp32 masters + 2 moments, 12 B/param
        assert sum(r["state_bytes"] for r in ranks) == 12 * ranks[0]["stage_numel"]


@pytest.mark.slow
def test_distributed_and_plain_optimizer_give_the_same_step(suite):
    sharded = _read_folder(suite["root"] / "step222")
    plain = _read_folder(suite["root"] / "step222_plain")
    for name, tensor in sharded.items():
        torch.testing.assert_close(tensor, plain[name], atol=TOL, rtol=0, msg=name)
    assert _case_results(suite, 8, 12)[0]["metrics"]["grad_norm"] == pytest.approx(
        _case_results(suite, 8, 4)[0]["metrics"]["grad_norm"], rel=1e-6)


@pytest.mark.slow
def test_overlapped_reduce_and_gather_give_the_same_step(suite):
    sharded = _read_folder(suite["root"] / "step222")
    overlapped = _read_folder(suite["root"] / "step222_overlap")
    for name, tensor in sharded.items():
        torch.testing.assert_close(tensor, overlapped[name], atol=TOL, rtol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("world,index", [(8, 4), (8, 6), (8, 9), (8, 12), (8, 13), (8, 14),
                                         (1, 1), (1, 2)])
def test_optimizer_state_roundtrip_resumes_bit_exact(suite, world, index):
    results = _case_results(suite, world, index)
    assert all(r["resume_exact"] and r["step_count"] == 2 for r in results)


@pytest.mark.slow
def test_nonfinite_gradients_on_one_rank_skip_the_update_everywhere(suite):
    results = _case_results(suite, 8, 15)
    for r in results:
        assert r["skipped"] == 1.0 and math.isnan(r["grad_norm"]) and r["unchanged"]
        assert r["step_count"] == 2 and r["next_skipped"] == 0.0  # steps 1 and 3 applied


@pytest.mark.slow
def test_builtin_model_from_config(suite):
    out = _case_results(suite, 1, 3)[0]
    assert out["actor"].shape == (4, 10) and np.all(out["actor"] < 0)
    np.testing.assert_array_equal(out["actor"], out["reference"])  # same seed, same weights
    assert out["critic"].shape == (4, 10) and np.all(np.isfinite(out["critic"]))


@pytest.mark.slow
def test_bf16_step_uses_fp32_master_weights(suite):
    """bf16 parameters: the step lands close to the fp32 step and stays bf16 on disk."""
    bf16 = _read_folder(suite["root"] / "step111_bf16")
    fp32 = _read_folder(suite["root"] / "step111")
    for name, tensor in bf16.items():
        assert tensor.dtype == torch.bfloat16, name
        torch.testing.assert_close(tensor.float(), fp32[name], atol=2e-2, rtol=2e-2, msg=name)
    metrics = _case_results(suite, 1, 2)[0]["metrics"]
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0


@pytest.mark.slow
def test_optimizer_step_222_tied_embeddings(suite):
    """pp=2 keeps two copies of the tied embedding; their gradients must be summed."""
    ref, ref_norm = _hf_train_step(suite["tied"], suite["batch"])
    step = _read_folder(suite["root"] / "step222_tied")
    assert "lm_head.weight" not in step
    for name, tensor in step.items():
        torch.testing.assert_close(tensor, ref[name], atol=TOL, rtol=0, msg=name)
    assert _case_results(suite, 8, 9)[0]["metrics"]["grad_norm"] == pytest.approx(ref_norm,
                                                                                 rel=1e-5)


@pytest.mark.slow
def test_critic_values_and_gradients(suite):
    results = _case_results(suite, 8, 5)
    values = _assemble(results, "values", 2)
    assert values.shape == (N_SEQS, SEQ)
    head = torch.as_tensor(next(r["head"] for r in results if r))  # [1, H]
    model = _hf_model(suite["untied"])
    hidden = model.model(torch.as_tensor(suite["batch"]["input_ids"])).last_hidden_state
    expected = (hidden @ head.T)[..., 0]
    np.testing.assert_allclose(values, expected.detach().numpy(), atol=TOL, rtol=0)
    train = _case_results(suite, 8, 6)
    for r in train:  # every gradient is non-zero, except on a vocab slice of pure padding
        expected_zero = ["embedding.word_embeddings.weight"] if r["vocab_start"] >= VOCAB else []
        assert r["zero_grads"] in ([], expected_zero), r["zero_grads"]
    assert math.isfinite(train[0]["metrics"]["vf"]) and train[0]["metrics"]["grad_norm"] > 0
    exported = _read_folder(suite["root"] / "crit")
    assert exported["score.weight"].shape == (1, 64) and "lm_head.weight" not in exported


@pytest.mark.slow
@pytest.mark.parametrize("index,which", [(7, "untied"), (8, "tied"), (11, "qwen2")])
def test_export_reload_roundtrip_exact(suite, index, which):
    from transformers import AutoConfig

    assert all(r["exact"] for r in _case_results(suite, 8, index))
    out = suite["cases"][8][index]["out"]
    exported, source = _read_folder(out), _read_folder(suite[which])
    assert set(exported) == set(source)
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name
    assert exported["model.embed_tokens.weight"].shape[0] == VOCAB  # no padding rows
    index_json = json.loads((__import__("pathlib").Path(out) / "model.safetensors.index.json")
                            .read_text())
    assert set(index_json["weight_map"]) == set(source)
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.tie_word_embeddings == (which == "tied") and cfg.num_key_value_heads == 2
    assert cfg.model_type == ("qwen2" if which == "qwen2" else "llama")


@pytest.mark.slow
def test_untied_checkpoint_without_lm_head_is_refused(suite):
    (index,) = [i for i, c in enumerate(suite["cases"][1]) if c["kind"] == "load_error"]
    (res,) = _case_results(suite, 1, index)
    assert res["error"] and "lm_head.weight" in res["error"]
