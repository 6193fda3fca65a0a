"""The SGLang adapter against SGLang 0.5.21's real Python modules, imported on CPU through the
test-only prelude (tests/support/sglang_prelude.py), in this one process.

Checked: the prelude imports every module the adapter and the multi-rank tests use; the
adapter's engine keywords construct a real ``ServerArgs``; the fake engine's signatures equal
the real ``Engine``'s (inspect, not parsing); every sampling dict is a valid real
``SamplingParams``; the pinned release honours ``sampling_seed`` only in deterministic mode (so
that mode is what ``rollout.deterministic`` opts into); SGLang's reductions patch is in force only
while CUDA tensors are serialized (process-wide it breaks pickling CPU tensors: shown here);
``engine_start_env`` hides the torchrun agent-store flag and undoes what SGLang's own env setter
does to the trainer process. The multi-rank checks are in tests/distributed/test_sglang_real.py.
"""

from __future__ import annotations

import inspect
import io
import multiprocessing as mp
import os
import signal
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from hybridrl.config.rollout import RolloutConfig
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.sglang.adapter import engine_start_kwargs, sampling_dicts
from hybridrl.rollout.sglang.env import AGENT_STORE, engine_start_env, scoped_torch_reductions

MODEL = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 8,
         "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 1000}


@pytest.fixture(scope="module")
def real():
    from tests.support.sglang_prelude import import_real_modules

    return import_real_modules()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("llama")
    LlamaConfig(**MODEL, torch_dtype="float32").save_pretrained(path)
    return str(path)


def _kwargs(model_path, **rollout):
    return engine_start_kwargs(model_path, tp_size=2, base=4, step=2, dtype=torch.bfloat16,
                               rollout=RolloutConfig(engine="sglang", **rollout))


def test_prelude_imports_the_real_modules(real):
    import sglang

    root = os.path.dirname(sglang.__file__)
    assert len(real) >= 15
    for name, module in real.items():
        assert module.__file__.startswith(root), (name, module.__file__)  # real, not stubbed


def test_adapter_kwargs_construct_real_server_args(real, model_path):
    kwargs = _kwargs(model_path)
    args = real["server_args"].ServerArgs(**kwargs, device="cpu")
    for key, value in kwargs.items():
        assert getattr(args, key) == value, key
    assert (args.tp_size, args.base_gpu_id, args.gpu_id_step) == (2, 4, 2)
    assert args.mem_fraction_static == 0.5 and args.enable_deterministic_inference is False
    assert args.load_format == "dummy" and args.dtype == "bfloat16"
    override = _kwargs(model_path, deterministic=True,
                       engine_kwargs={"mem_fraction_static": 0.8, "disable_cuda_graph": True})
    args = real["server_args"].ServerArgs(**override, device="cpu")
    assert args.mem_fraction_static == 0.8 and args.disable_cuda_graph
    assert args.enable_deterministic_inference is True


def _params(fn) -> list[tuple]:
    """(name, kind, default) of every parameter (annotations aside: the fake has none)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_fake_engine_signatures_equal_the_real_ones(real):
    from tests.support.sglang_fake import FakeEngine, FakeUpdateWeightsFromTensorReqInput

    engine = real["engine"].Engine
    for name in ("generate", "flush_cache", "release_memory_occupation",
                 "resume_memory_occupation", "begin_weight_update", "end_weight_update"):
        assert _params(getattr(FakeEngine, name)) == _params(getattr(engine, name)), name
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    upd = TokenizerManager.update_weights_from_tensor
    assert inspect.iscoroutinefunction(upd)
    assert list(inspect.signature(upd).parameters) == ["self", "obj", "request"]
    req = real["io_struct"].UpdateWeightsFromTensorReqInput
    fake = set(FakeUpdateWeightsFromTensorReqInput.__dataclass_fields__)
    assert fake <= set(req.__struct_fields__)
    built = req(serialized_named_tensors=[b"x"], load_format="direct", flush_cache=False)
    assert (built.load_format, built.flush_cache) == ("direct", False)


def test_sampling_dicts_are_real_sampling_params(real):
    params = SamplingParams(max_new_tokens=4, temperature=0.7, top_k=5, top_p=0.9,
                            eos_token_id=2, seed=2**62)
    for d in sampling_dicts(params, 3):
        sp = real["sampling_params"].SamplingParams(**d)
        sp.verify(1000)
        assert sp.sampling_seed == d["sampling_seed"] and sp.stop_token_ids == {2}


def test_seeds_are_honoured_only_in_deterministic_mode(real):
    """Why ``rollout.deterministic`` exists: SGLang's batch builder passes per-request seeds to
    the sampler only when deterministic inference is on (checked on the imported class)."""
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    src = inspect.getsource(SamplingBatchInfo.from_schedule_batch)
    assert "enable_deterministic = get_exec().deterministic.enable_deterministic_inference" in src
    seed_block = src[src.index("sampling_seed = ("):]
    assert "if enable_deterministic" in seed_block[:seed_block.index("logit_bias")]


def _pickle(obj) -> bytes:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


def test_reductions_patch_is_scoped(real):
    from torch.multiprocessing import reductions

    from hybridrl.rollout.sglang.adapter import sglang_backend

    torch_reduce = reductions.reduce_tensor
    backend = sglang_backend()  # used to patch the whole process here
    assert reductions.reduce_tensor is torch_reduce
    cpu = [("model.norm.weight", torch.arange(4.0))]
    (name, back), = real["common"].MultiprocessingSerializer.deserialize(backend.serialize(cpu))
    assert name == "model.norm.weight" and torch.equal(back, cpu[0][1])
    patch = real["patch_torch"].monkey_patch_torch_reductions
    with scoped_torch_reductions(patch):
        assert reductions.reduce_tensor is not torch_reduce
        with pytest.raises(IndexError):  # what a process-wide patch does to CPU tensors
            _pickle(torch.zeros(2))
    assert reductions.reduce_tensor is torch_reduce
    assert not hasattr(reductions, "_reduce_tensor_original")
    _pickle(torch.zeros(2))  # CPU tensors pickle again (e.g. data-loader workers)


def test_engine_start_env_undoes_sglangs_env_setter(real, model_path, monkeypatch):
    monkeypatch.setenv(AGENT_STORE, "True")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    for key in ("NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE", "CUDA_DEVICE_MAX_CONNECTIONS"):
        monkeypatch.delenv(key, raising=False)
    before = dict(os.environ)
    method, sigquit = mp.get_start_method(allow_none=True), signal.getsignal(signal.SIGQUIT)
    args = real["server_args"].ServerArgs(**_kwargs(model_path, deterministic=True),
                                          device="cpu")
    try:
        with engine_start_env():
            assert AGENT_STORE not in os.environ  # what the spawned schedulers inherit
            real["engine"]._set_envs_and_config(args)  # SGLang's own setter, as Engine runs it
            assert os.environ["NCCL_CUMEM_ENABLE"] == "0"
            assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
            assert mp.get_start_method() == "spawn"
        changed = {k for k in set(before) | set(os.environ)
                   if (k.startswith("NCCL_") or k in (AGENT_STORE, "CUDA_DEVICE_MAX_CONNECTIONS"))
                   and before.get(k) != os.environ.get(k)}
        assert changed == set(), changed
        assert mp.get_start_method(allow_none=True) == method
    finally:
        signal.signal(signal.SIGQUIT, sigquit)
