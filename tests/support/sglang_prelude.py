"""Test-only prelude: lets SGLang's real Python modules import on a CPU machine.

Contract: ``install()`` (idempotent; call it before the first ``import sglang...``) makes the
pinned SGLang release (``sglang_compat.TEST_PIN``, installed with ``--no-deps`` plus its pure-
Python dependencies, see the Makefile) importable without CUDA:
- ``torchvision``: SGLang's multimodal helpers import it at module level. Where it does not
  import (absent, or a build linked against a CUDA torch), a stub package stands in whose
  attributes are inert placeholder classes; nothing the tests run calls them.
- ``vllm._custom_ops``: the same, for the optional vLLM kernels some layers probe for.
- transformers is told torchvision is absent (``is_torchvision_available`` answers False), so
  it never tries to build the torchvision-backed image processors the stub cannot serve.
Then ``server_args``, ``sampling_params``, ``io_struct``, ``entrypoints.engine`` (the ``Engine``
class), the scheduler-side weight updater, ``weight_sync.utils``, ``layers.linear``,
``vocab_parallel_embedding`` and the model modules (llama, qwen2, ...) import
(``REAL_MODULES``; ``import_real_modules()`` imports them all and returns them by short name).
Nothing here is used by the library; only tests (and hybridrl/testing helpers) install it.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types

STUBBED = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
           "torchvision.transforms.v2", "torchvision.io", "vllm", "vllm._custom_ops")

REAL_MODULES = {
    "server_args": "sglang.srt.server_args",
    "sampling_params": "sglang.srt.sampling.sampling_params",
    "io_struct": "sglang.srt.managers.io_struct",
    "engine": "sglang.srt.entrypoints.engine",
    "scheduler_weight_updater": "sglang.srt.managers.scheduler_components.weight_updater",
    "runner_weight_updater": "sglang.srt.model_executor.model_runner_components.weight_updater",
    "tp_worker": "sglang.srt.managers.tp_worker",
    "weight_sync": "sglang.srt.weight_sync.utils",
    "linear": "sglang.srt.layers.linear",
    "vocab_parallel_embedding": "sglang.srt.layers.vocab_parallel_embedding",
    "parallel_state": "sglang.srt.distributed.parallel_state",
    "patch_torch": "sglang.srt.utils.patch_torch",
    "common": "sglang.srt.utils.common",
    "llama": "sglang.srt.models.llama",
    "qwen2": "sglang.srt.models.qwen2",
}


def _placeholder(name: str) -> type:
    return type(name, (), {"__init__": lambda self, *args, **kwargs: None})


def _stub(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []
    module.__version__ = "0.0.0+stub"

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _placeholder(attr)

    module.__getattr__ = __getattr__
    return module


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # absent, or linked against another torch (CUDA-only symbols)
        sys.modules.pop(name, None)
        return False
    return True


def install() -> None:
    """Stub what SGLang's CPU import path lacks (see the module docstring); idempotent."""
    import transformers.utils
    from transformers.utils import import_utils

    stub_vision = not _importable("torchvision")
    if stub_vision:
        def no_torchvision() -> bool:
            return False

        for module in (import_utils, transformers.utils):
            module.is_torchvision_available = no_torchvision
    for name in STUBBED:
        top = name.split(".")[0]
        if name in sys.modules or (top == "torchvision" and not stub_vision):
            continue
        if top == "vllm" and _importable("vllm._custom_ops"):
            continue
        sys.modules[name] = _stub(name)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, sys.modules[name])


def import_real_modules() -> dict[str, types.ModuleType]:
    """``install()``, then import every module of ``REAL_MODULES``: {short name: module}."""
    install()
    return {short: importlib.import_module(path) for short, path in REAL_MODULES.items()}
