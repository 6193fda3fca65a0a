"""Llama 3.x, Qwen3 and Qwen2.5 + yarn on the GPU layer spec (skipped without CUDA).

One NCCL rank in this process (layout (1,1,1)); the layer spec is transformer-engine's when it
imports (TE's fused q/k norms, TE core attention with yarn's softmax scale), else megatron's
local spec; the spec used is printed. For every family of tests/distributed/
test_models_families.py (the same scaled-down real config.json files): actor log-probs and
entropy equal transformers' (fp32, TF32 off) within 2e-4, the critic's values equal
transformers' final hidden state @ its head, and an export reloads in transformers with the
same log-probs. Run: ``pytest -s tests/gpu/test_models_families_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gpu.test_models_gpu import groups  # noqa: F401  (the NCCL (1,1,1) fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GPU_TOL = 2e-4


def _families():
    from tests.distributed.test_models_families import FAMILIES

    return list(FAMILIES)


@pytest.mark.parametrize("name", _families())
def test_family_on_gpu_spec_matches_transformers(groups, tmp_path, name):  # noqa: F811
    from hybridrl.models.forward import run_microbatches
    from hybridrl.models.hf_io import build_from_hf, export_hf
    from hybridrl.models.naming import named_local_parameters
    from tests.distributed import test_models_cases as cases
    from tests.distributed import test_models_families as fam

    folder = fam.save_family(str(tmp_path / name), fam.FAMILIES[name], seed=0)
    batch = cases.make_batch(0, 4, 12, fam.VOCAB)
    mbs = [{k: v.cuda() for k, v in mb.items()}
           for mb in cases.split_microbatches(batch, 1, 0, 2)]
    ref_logp, ref_ent = fam.hf_logprobs(fam.hf_model(folder), batch["input_ids"])
    actor = build_from_hf(folder, groups, "actor")
    out = run_microbatches(actor, mbs)
    logp = np.concatenate([o["logprobs"].cpu().numpy() for o in out])
    ent = np.concatenate([o["entropy"].cpu().numpy() for o in out])
    err = float(np.abs(logp - ref_logp).max())
    print(f"SUMMARY: {name} on the {'TE' if actor.uses_te else 'local'} spec: "
          f"max |dlogprob| {err:.2e}")
    np.testing.assert_allclose(logp, ref_logp, atol=GPU_TOL, rtol=0)
    np.testing.assert_allclose(ent, ref_ent, atol=GPU_TOL, rtol=0)
    export_hf(actor, str(tmp_path / "export"))
    again, _ = fam.hf_logprobs(fam.hf_model(str(tmp_path / "export")), batch["input_ids"])
    np.testing.assert_allclose(again, ref_logp, atol=GPU_TOL, rtol=0)
    critic = build_from_hf(folder, groups, "critic")
    values = np.concatenate([o["values"].cpu().numpy() for o in run_microbatches(critic, mbs)])
    head = dict(named_local_parameters(critic))["output_layer.weight"].detach().cpu()
    model = fam.hf_model(folder)
    with torch.no_grad():
        hidden = model.model(torch.as_tensor(batch["input_ids"])).last_hidden_state
    np.testing.assert_allclose(values, (hidden @ head.T)[..., 0].numpy(), atol=GPU_TOL, rtol=0)
