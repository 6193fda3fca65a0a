"""Packed = padded on the GPU layer spec (skipped without CUDA): megatron's THD path.

One NCCL rank (the ``groups`` fixture of tests/gpu/test_models_gpu.py). With transformer-engine
installed the model is built on the TE spec, so a packed micro-batch goes through megatron's own
THD path (``PackedSeqParams`` to TE's attention and RoPE: cu_seqlens, padding-causal mask); else
the local spec's varlen attention on CUDA. The case body is the CPU one
(tests/distributed/packing_cases.py: actor and critic from one HF checkpoint, right-padded vs
packed micro-batches incl. a one-token sequence and a pack of one sequence): response log-probs,
entropy, values, losses, grad norms and gradients agree within 2e-4 (fp32, TF32 off; TE's THD
and BSHD attention kernels sum in different orders).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_models_gpu import groups  # noqa: F401  (the NCCL rank fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPU_TOL = 2e-4


def test_packed_equals_padded_on_the_gpu_spec(groups, tmp_path):  # noqa: F811
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridrl.models.build import transformer_engine_available
    from tests.distributed import packing_cases

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=64))
    model.save_pretrained(str(tmp_path / "llama"))
    out = packing_cases.packed_vs_padded(groups, {"folder": str(tmp_path / "llama")})
    print(f"SUMMARY: packed vs padded on the {'TE' if transformer_engine_available() else 'local'}"
          f" spec (GPU): max diffs " + ", ".join(f"{k} {v:.1e}" for k, v in out["diffs"].items()))
    for key, diff in out["diffs"].items():
        tol = 10 * GPU_TOL if key.endswith("_params") else GPU_TOL
        assert diff <= tol, (key, diff)
