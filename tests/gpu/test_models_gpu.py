"""GPU checks of hybridrl.models (skipped without CUDA): NCCL at (1,1,1) and a ~1B llama step.

Run on a GPU machine with ``pytest -s tests/gpu/test_models_gpu.py`` (``-s`` shows the printed
throughput and memory; scripts/gpu_check.py stage ``models`` copies the ``SUMMARY: `` lines).
One NCCL rank in this process; the layer spec is transformer-engine's when
it imports, else megatron's local spec (both are reported).
- log-probs/entropy of a tiny GQA llama equal transformers' (fp32, TF32 off) within 2e-4;
- one optimizer step of the same model: the gradient norm equals transformers' (rel 1e-4) and the
  weights equal transformers + torch AdamW within 2e-4 (up to sign flips of ~0 gradients);
- a ~1.1B llama shape (hidden 2048, 20 layers, 16 heads / 8 query groups, SwiGLU 5632,
  vocab 32000) runs bf16 forward/backward + AdamW over 4 micro-batches of [2, 1024] tokens:
  tokens/s and peak memory are printed;
- the same model with the distributed optimizer and full recompute: CUDA peak memory within
  0.75-1.35x of `hybridrl plan --memory`'s train phase, tokens/s and MFU printed.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GPU_TOL = 2e-4


@pytest.fixture(scope="module")
def groups():
    import torch.distributed as dist

    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout
    from hybridrl.testing.dist import free_port

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    created = not dist.is_initialized()
    if created:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=300))
    yield build_groups(TrainLayout(world=1))
    from hybridrl.parallel.megatron import clear_megatron_groups

    clear_megatron_groups()
    if created:
        dist.destroy_process_group()


def test_logprobs_and_step_match_transformers_nccl(groups, tmp_path):
    from hybridrl.models.forward import run_microbatches
    from hybridrl.models.hf_io import build_from_hf, export_hf
    from hybridrl.models.train_step import ModelOptimizer, OptimConfig, train_step
    from tests.distributed import test_models as ref
    from tests.distributed import test_models_cases as cases

    folder = ref._save_tiny(str(tmp_path / "tiny"), tie=False)
    batch = cases.make_batch(0, ref.N_SEQS, ref.SEQ, ref.VOCAB)
    model = build_from_hf(folder, groups, "actor")
    print(f"\nSUMMARY: models: NCCL (1,1,1) vs transformers with the "
          f"{'transformer-engine' if model.uses_te else 'local'} layer spec")
    out = run_microbatches(model, cases.split_microbatches(batch, 1, 0, ref.N_MICRO))
    logp = torch.cat([o["logprobs"] for o in out]).cpu()
    ent = torch.cat([o["entropy"] for o in out]).cpu()
    ref_logp, ref_ent = ref._hf_logprobs(ref._hf_model(folder), batch["input_ids"])
    torch.testing.assert_close(logp, ref_logp, atol=GPU_TOL, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=GPU_TOL, rtol=0)

    opt = ModelOptimizer(model, OptimConfig(lr=cases.LR, weight_decay=cases.WEIGHT_DECAY,
                                            grad_clip=cases.GRAD_CLIP))
    mbs = cases.split_microbatches(batch, 1, 0, ref.N_MICRO * 2)
    metrics = train_step(model, opt, mbs, cases.actor_loss)
    export_hf(model, tmp_path / "step")
    expected, norm = ref._hf_train_step(folder, batch)
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-4)
    # Adam's first step moves every weight by about lr * sign(g): a gradient within GPU rounding
    # of 0 may flip sign, so allow those rare elements 2 * lr; all others must agree to GPU_TOL.
    for name, tensor in ref._read_folder(tmp_path / "step").items():
        err = (tensor - expected[name]).abs()
        assert float(err.max()) <= 2 * cases.LR + GPU_TOL, name
        assert float((err > GPU_TOL).float().mean()) <= 1e-3, name


def test_1b_llama_forward_backward_throughput(groups):
    from hybridrl.models.build import build_model
    from hybridrl.models.spec import LlamaSpec
    from hybridrl.models.train_step import ModelOptimizer, OptimConfig, train_step
    from tests.distributed import test_models_cases as cases

    spec = LlamaSpec(hidden_size=2048, num_layers=20, num_attention_heads=16,
                     num_query_groups=8, ffn_hidden_size=5632, vocab_size=32000,
                     max_position_embeddings=4096)
    torch.cuda.reset_peak_memory_stats()
    model = build_model(spec, groups, "actor", dtype="bf16")
    n_params = sum(p.numel() for p in model.module.parameters())
    opt = ModelOptimizer(model, OptimConfig(lr=1e-5))
    b, t, n_micro = 2, 1024, 4
    batch = cases.make_batch(0, b * n_micro, t, spec.vocab_size)
    mbs = cases.split_microbatches(batch, 1, 0, n_micro)
    train_step(model, opt, mbs, cases.actor_loss)  # warm-up (allocations, kernels)
    torch.cuda.synchronize()
    steps, start = 3, time.perf_counter()
    for _ in range(steps):
        metrics = train_step(model, opt, mbs, cases.actor_loss)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens_per_s = steps * b * t * n_micro / elapsed
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    print(f"\nSUMMARY: models: ~1B llama ({n_params / 1e9:.2f}B params, bf16, "
          f"{'TE' if model.uses_te else 'local'} spec): {tokens_per_s:,.0f} tokens/s "
          f"(fwd+bwd+AdamW), peak memory {peak_gib:.1f} GiB, loss {metrics['loss']:.4f}")
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0


def test_1b_llama_memory_matches_the_plan(groups):
    """The ~1B llama with the distributed optimizer and full recompute, one bf16 step: CUDA's
    peak allocated memory against ``hybridrl plan --memory``'s train phase (weights, fp32 grads,
    optimizer, activations; no reserve), and MFU against the H200's 989 dense bf16 TFLOP/s."""
    from hybridrl.config.model import ModelConfig
    from hybridrl.models.hf_io import build_from_config
    from hybridrl.models.train_step import ModelOptimizer, OptimConfig, train_step
    from hybridrl.planning.memory import MemoryJob, activation_bytes, model_state_bytes
    from hybridrl.reshard.specs import LlamaShape
    from tests.distributed import test_models_cases as cases

    sizes = dict(hidden_size=2048, num_layers=20, num_attention_heads=16, num_query_groups=8,
                 ffn_hidden_size=5632, vocab_size=32000, max_position_embeddings=4096)
    b, t, n_micro = 2, 1024, 4
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = build_from_config(ModelConfig(dtype="bf16", recompute_granularity="full", **sizes),
                              groups, "actor")
    opt = ModelOptimizer(model, OptimConfig(lr=1e-5))
    batch = cases.make_batch(0, b * n_micro, t, sizes["vocab_size"])
    mbs = cases.split_microbatches(batch, 1, 0, n_micro)
    train_step(model, opt, mbs, cases.actor_loss)
    torch.cuda.synchronize()
    start, steps = time.perf_counter(), 3
    for _ in range(steps):
        train_step(model, opt, mbs, cases.actor_loss)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    measured = torch.cuda.max_memory_allocated() - base
    shape = LlamaShape(hidden=2048, ffn=5632, heads=16, num_query_groups=8, layers=20,
                       vocab=32000)
    job = MemoryJob(shape, world=1, dtype="bf16", max_tokens_per_gpu=b * t, seq_len=t,
                    recompute="full", critic=False, ref=False,
                    spec="te" if model.uses_te else "local")
    state = model_state_bytes(job, "actor", 0)
    planned = sum(state.values()) + activation_bytes(job, 0)
    n_params = sum(p.numel() for p in model.module.parameters())
    tokens_per_s = steps * b * t * n_micro / elapsed
    mfu = 6 * n_params * tokens_per_s / 989e12  # recompute's extra forward not counted
    print(f"\nSUMMARY: models: ~1B llama, distributed optimizer + full recompute ({'TE' if model.uses_te else 'local'}"
          f" spec): peak {measured / 2**30:.2f} GiB vs plan {planned / 2**30:.2f} GiB "
          f"(ratio {measured / planned:.2f}), {tokens_per_s:,.0f} tokens/s, MFU {mfu:.1%}")
    assert 0.75 * planned <= measured <= 1.35 * planned
