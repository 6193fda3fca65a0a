"""What an SGLang engine may change in the trainer process, and how the adapter contains it.

Contract (no SGLang import at module level):
- ``engine_start_env(label)``: context manager around ``sglang.Engine(...)`` on a source rank;
  it yields ``EngineWatch(label)``, whose ``sigquit`` the adapter passes as SGLang's
  ``custom_sigquit_handler`` and whose ``contain(engine)`` it calls on the started engine.
  Inside it ``TORCHELASTIC_USE_AGENT_STORE`` is unset (torchrun sets it in every worker, the
  engine's spawned schedulers inherit it, and SGLang's ``init_distributed_environment``
  (``tcp://127.0.0.1:<nccl_port>``) would then make every scheduler a client of a TCP store
  nobody hosts) and ``ENGINE_ENV`` is set: ``SGLANG_MEMORY_SAVER_CUDA_GRAPH=1``, without which
  SGLang 0.5.21 keeps its CUDA graphs out of the memory saver (default off), so releasing the
  "cuda_graph" tag would leave them on the GPU through training. The spawned schedulers read
  the variables they were started with. On exit the trainer process gets back exactly what it
  had for the variables in ``GUARDED`` (the agent-store flag, ``CUDA_DEVICE_MAX_CONNECTIONS``),
  every ``NCCL_*`` and every ``SGLANG_*`` variable, whatever SGLang's ``_set_envs_and_config``
  and its deterministic-inference hook wrote (``NCCL_CUMEM_ENABLE``, ``NCCL_NVLS_ENABLE``,
  ``NCCL_ALGO``, ``CUDA_DEVICE_MAX_CONNECTIONS=8``, ``SGLANG_RUN_ID``, ...): the trainer's
  communicators (created later, e.g. megatron's) must not see them on source ranks only. Also
  restored: the multiprocessing start method SGLang forces to ``spawn``, the root logger's
  handlers and level (SGLang's ``configure_logger`` resets them with ``basicConfig(force=True)``)
  and the SIGTERM handler. SIGQUIT is left to ``EngineWatch.sigquit`` (main thread only).
- ``EngineWatch(label)``: ``sigquit`` is the engine's SIGQUIT handler for the rest of the
  process: SGLang's scheduler and detokenizer processes signal their parent with SIGQUIT when
  they fail, and SGLang's own handlers (the launch-phase one, and the running-phase one its
  tokenizer manager adds to the event loop at its first request) SIGKILL the whole process
  tree, the trainer included, silently. Here the first SIGQUIT raises ``EngineDied`` (a
  RuntimeError, one line: ``label`` plus what happened) in the main thread, which the trainer
  reports as any failure after start (status 1); later ones are ignored. ``contain(engine)``
  runs the engine's ``tokenizer_manager.auto_create_handle_loop()`` inside ``engine.loop`` (so
  its signal handlers are added now, not at the first request), then removes the SIGTERM and
  SIGQUIT handlers it added to the loop; ``engine_start_env`` then restores SIGTERM and installs
  ``sigquit``.
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
import logging
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable

AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
GUARDED = (AGENT_STORE, "CUDA_DEVICE_MAX_CONNECTIONS")
GUARDED_PREFIXES = ("NCCL_", "SGLANG_")
ENGINE_ENV = {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}  # what the engine's processes must see


class EngineDied(RuntimeError):
    """A process of an SGLang engine failed (it signalled SIGQUIT to this process)."""


def _guarded(key: str) -> bool:
    return key in GUARDED or key.startswith(GUARDED_PREFIXES)


def _guarded_items() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if _guarded(k)}


class EngineWatch:
    """The engine's SIGQUIT handler and the containment of its event loop (module docstring)."""

    def __init__(self, label: str):
        self.label = label
        self.fired = False

    def sigquit(self, signum=None, frame=None) -> None:
        if self.fired:  # every failing child signals: one report
            return
        self.fired = True
        raise EngineDied(f"{self.label}: one of its processes (scheduler or detokenizer) "
                         "failed and signalled SIGQUIT; SGLang's log lines above say why")

    def contain(self, engine) -> None:
        """Add SGLang's event-loop signal handlers now, then take them off the loop."""
        manager = getattr(engine, "tokenizer_manager", None)
        loop = getattr(engine, "loop", None)
        arm = getattr(manager, "auto_create_handle_loop", None)
        if arm is None or loop is None:
            return

        async def armed() -> None:
            arm()

        loop.run_until_complete(armed())
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGQUIT):
                loop.remove_signal_handler(sig)


@contextlib.contextmanager
def engine_start_env(label: str = "SGLang engine"):
    """Start an SGLang engine without the agent-store flag, with ``ENGINE_ENV``; restore the
    guarded variables, start method, root logger and signal handlers (module docstring)."""
    before = _guarded_items()
    method = mp.get_start_method(allow_none=True)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    main = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main else None
    watch = EngineWatch(label)
    os.environ.pop(AGENT_STORE, None)
    os.environ.update(ENGINE_ENV)
    try:
        yield watch
    finally:
        for key in [k for k in os.environ if _guarded(k)]:
            if key not in before:
                del os.environ[key]
        os.environ.update(before)
        if mp.get_start_method(allow_none=True) != method:
            mp.set_start_method(method, force=True)
        root.handlers[:] = handlers
        root.setLevel(level)
        if main:
            if sigterm is not None:  # None: a handler not set from Python, nothing to restore
                signal.signal(signal.SIGTERM, sigterm)
            signal.signal(signal.SIGQUIT, watch.sigquit)


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
