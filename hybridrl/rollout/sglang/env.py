"""What an SGLang engine may change in the trainer process, and how the adapter contains it.

Contract (no SGLang import at module level):
- ``engine_start_env()``: context manager around ``sglang.Engine(...)`` on a source rank.
  Inside it ``TORCHELASTIC_USE_AGENT_STORE`` is unset: torchrun sets it in every worker, the
  engine's spawned scheduler processes inherit it, and SGLang's ``init_distributed_environment``
  (``tcp://127.0.0.1:<nccl_port>``) would then make every scheduler a client of a TCP store nobody
  hosts and wait for the store timeout. On exit the trainer process gets back exactly what it
  had for the variables in ``GUARDED`` (the agent-store flag, ``CUDA_DEVICE_MAX_CONNECTIONS``) and
  every ``NCCL_*`` variable, whatever SGLang's ``_set_envs_and_config`` and its deterministic-
  inference hook wrote (``NCCL_CUMEM_ENABLE``, ``NCCL_NVLS_ENABLE``, ``NCCL_ALGO``, channel
  counts, ``CUDA_DEVICE_MAX_CONNECTIONS=8``): the schedulers were spawned with them, the trainer's
  communicators (created later, e.g. megatron's) must not see them on source ranks only. The
  multiprocessing start method SGLang forces to ``spawn`` is restored too. Other variables SGLang
  sets for itself (``SGLANG_*``, logging) stay.
- ``sglang_serializer(serialize)``: wraps SGLang's ``MultiprocessingSerializer.serialize`` so that
  SGLang's ``monkey_patch_torch_reductions`` (CUDA tensors pickle by device UUID, as the
  schedulers expect) is in force only while a payload with CUDA tensors is serialized, then
  undone (``scoped_torch_reductions``): process-wide it breaks pickling of CPU tensors through
  multiprocessing (the patched reducer indexes a CUDA-only argument), e.g. data-loader workers.
  CPU tensors serialize with torch's own reducers.
- ``scoped_torch_reductions(patch)``: run ``patch()`` (SGLang's patch) and restore torch's tensor
  reducers and ``ForkingPickler``'s table on exit, whoever patched inside (tests wrap SGLang's
  scheduler-side code with it, which patches too).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from collections.abc import Callable

AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
GUARDED = (AGENT_STORE, "CUDA_DEVICE_MAX_CONNECTIONS")


def _guarded_items() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k in GUARDED or k.startswith("NCCL_")}


@contextlib.contextmanager
def engine_start_env():
    """Start an SGLang engine without the agent-store flag; restore the guarded variables."""
    before = _guarded_items()
    method = mp.get_start_method(allow_none=True)
    os.environ.pop(AGENT_STORE, None)
    try:
        yield
    finally:
        for key in [k for k in os.environ if k in GUARDED or k.startswith("NCCL_")]:
            if key not in before:
                del os.environ[key]
        os.environ.update(before)
        if mp.get_start_method(allow_none=True) != method:
            mp.set_start_method(method, force=True)


@contextlib.contextmanager
def scoped_torch_reductions(patch: Callable[[], None]):
    """``patch()`` in force inside; torch's tensor reducers restored on exit."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    saved = {name: getattr(reductions, name) for name in ("reduce_tensor", "rebuild_cuda_tensor")}
    table = dict(ForkingPickler._extra_reducers)
    marks = {name: getattr(reductions, name) for name in
             ("_reduce_tensor_original", "_rebuild_cuda_tensor_original") if hasattr(reductions, name)}
    patch()
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(reductions, name, value)
        for name in ("_reduce_tensor_original", "_rebuild_cuda_tensor_original"):
            if name in marks:
                setattr(reductions, name, marks[name])
            elif hasattr(reductions, name):
                delattr(reductions, name)
        ForkingPickler._extra_reducers.clear()
        ForkingPickler._extra_reducers.update(table)


def sglang_serializer(serialize: Callable, patch: Callable[[], None]) -> Callable:
    """[(name, tensor)] -> payload, with SGLang's reductions patch only around CUDA tensors."""
    def run(named) -> bytes:
        named = list(named)
        if any(t.is_cuda for _, t in named):
            with scoped_torch_reductions(patch):
                return serialize(named)
        return serialize(named)

    return run
