"""SGLang 0.5.21's process-wide side effects contained by the adapter (issue 37 items 1, 3, 5),
against SGLang's real modules on CPU:
- one process (tests/support/sglang_signals.py) runs SGLang's own logger and env setters and
  its tokenizer manager's signal set-up behind ``engine_start_env``: a process spawned inside
  reads ``SGLANG_MEMORY_SAVER_CUDA_GRAPH`` as on through SGLang's own readers (its CUDA graphs
  go under the memory saver), the trainer keeps its SIGTERM handler, root logger and SGLANG_*
  variables, and a child signalling SIGQUIT as SGLang's failing scheduler does becomes one
  ``EngineDied`` line naming the engine and rank (SGLang's handler SIGKILLs the process tree);
- the release after generate awaits SGLang's real deferred flush (``SchedulerFlushWrapper``)
  until the scheduler is idle, then SGLang's real ``release_memory_occupation`` (whose idle
  assertion would otherwise fail in the scheduler); a scheduler not idle in time is one error
  on the caller's side and no release.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("llama")
    LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=8,
                num_key_value_heads=4, num_hidden_layers=2, vocab_size=1000).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def signals(model_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("SGLANG_MEMORY_SAVER_CUDA_GRAPH", None)
    proc = subprocess.run([sys.executable, "-m", "tests.support.sglang_signals", model_path],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = proc.stdout.splitlines()
    state = next((json.loads(ln[6:]) for ln in lines if ln.startswith("STATE ")), None)
    return proc, state, [ln for ln in lines if ln.startswith(("CAUGHT ", "NO SIGNAL"))]


@pytest.mark.slow  # one process importing SGLang: ~13 s
def test_engine_processes_put_cuda_graphs_under_the_memory_saver(signals):
    proc, state, _ = signals
    assert state is not None, proc.stderr[-3000:]
    assert state["child"] == {"environ": True, "get_bool_env_var": True}


@pytest.mark.slow  # one process importing SGLang: ~13 s
def test_trainer_keeps_its_sigterm_handler_logger_and_sglang_variables(signals):
    proc, state, _ = signals
    assert state is not None, proc.stderr[-3000:]
    assert state["armed"] and state["wakeup_free"]  # SGLang's loop handlers added, taken off
    assert state["sigterm_kept"] and state["root_kept"] and state["sglang_env_kept"], state
    assert state["sigquit_is_watch"]
    # during the launch SGLang installs the adapter's handler (custom_sigquit_handler), not
    # its own, and the ServerArgs carrying it pickle for the schedulers
    assert state["launch_handler_is_watch"] and state["ships"]


@pytest.mark.slow  # one process importing SGLang: ~13 s
def test_a_failing_scheduler_is_one_line_naming_the_engine(signals):
    proc, state, caught = signals
    # SGLang's own handler would SIGKILL the whole process tree: status -9, nothing printed
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert caught == ["CAUGHT rank 3: the SGLang engine of gen-TP group [3] (source rank 3): one "
                      "of its processes (scheduler or detokenizer) failed and signalled SIGQUIT; "
                      "SGLang's log lines above say why"]


# ---- item 5: release only once the scheduler is idle --------------------------------------------


class _Scheduler:
    """SGLang's real flush wrapper and weight-updater manager over a scheduler that stays busy
    for ``busy`` more event-loop iterations after generate (its last requests finishing)."""

    def __init__(self, busy: int):
        from tests.support.sglang_prelude import install

        install()
        from sglang.srt.managers.scheduler_components.flush_wrapper import SchedulerFlushWrapper
        from sglang.srt.managers.scheduler_components.weight_updater import (
            SchedulerWeightUpdaterManager,
        )
        from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

        self.busy, self.sent, self.flushed = busy, [], 0
        channels = types.SimpleNamespace(send_to_tokenizer=types.SimpleNamespace(
            send_output=lambda out, req: self.sent.append(out)))
        self.flush = SchedulerFlushWrapper(flush_cache=self._flush_cache,
                                           is_fully_idle=self.idle, ipc_channels=channels)
        self.manager = SchedulerWeightUpdaterManager(
            tp_worker=None, draft_worker=None, tp_cpu_group=None,
            memory_saver_adapter=TorchMemorySaverAdapter.create(enable=False),
            flush_cache=self._flush_cache, is_fully_idle=lambda **kw: self.idle(),
            scheduler=types.SimpleNamespace(_engine_paused=False, disaggregation_mode=None))

    def idle(self) -> bool:
        return self.busy == 0

    def _flush_cache(self) -> bool:
        self.flushed += 1
        return self.idle()

    def iterate(self) -> None:  # one scheduler event-loop iteration
        self.busy = max(self.busy - 1, 0)
        self.flush.check_pending()


class _Engine:
    """The source's ``sglang.Engine`` over ``_Scheduler`` (what the adapter calls)."""

    def __init__(self, scheduler: _Scheduler):
        self.scheduler, self.calls = scheduler, []
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = types.SimpleNamespace(flush_cache=self._flush_cache)

    async def _flush_cache(self, timeout_s=None):
        from sglang.srt.managers.io_struct import FlushCacheReqInput

        self.calls.append(("flush_cache", timeout_s))
        out = self.scheduler.flush.handle(FlushCacheReqInput(timeout_s=timeout_s))
        while out is None:  # deferred: the scheduler answers once idle or past the timeout
            await asyncio.sleep(0.01)
            self.scheduler.iterate()
            out = self.scheduler.sent.pop() if self.scheduler.sent else None
        return out

    def release_memory_occupation(self, tags=None):
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        self.calls.append("release_memory_occupation")
        # SGLang's scheduler-side handler (tags: the CUDA graphs alone, which need no process
        # group here); its first statement is the idle assertion
        self.scheduler.manager.release_memory_occupation(
            ReleaseMemoryOccupationReqInput(tags=["cuda_graph"]))


def _handle(scheduler, timeout_s=120.0):
    from hybridrl.rollout.sglang.adapter import SGLangEngine
    from tests.support.sglang_fake import fake_backend

    engine = _Engine(scheduler)
    handle = SGLangEngine(engine, fake_backend(), rank=0, members=[0], tp_group=None,
                          table={}, dtype=torch.float32, timeout_s=timeout_s)
    handle.released = False  # after generate
    return handle, engine


def test_release_waits_until_the_scheduler_is_idle():
    scheduler = _Scheduler(busy=5)
    handle, engine = _handle(scheduler)
    handle.release()  # without the flush first, SGLang's idle assertion fails in the scheduler
    assert engine.calls == [("flush_cache", 60.0), "release_memory_occupation"]
    assert scheduler.idle() and scheduler.flushed == 1


def test_a_scheduler_busy_past_the_flush_timeout_is_one_error_and_no_release():
    scheduler = _Scheduler(busy=10**9)
    handle, engine = _handle(scheduler, timeout_s=0.2)
    with pytest.raises(RuntimeError) as err:
        handle.release()
    assert str(err.value).startswith("rank 0: the SGLang engine of gen-TP group [0]: its "
                                     "scheduler was not idle within 0.1 s after generate "
                                     "(flush_cache: Timed out waiting for idle state.)")
    assert "release_memory_occupation" not in engine.calls


# ---- item 2: the balance rule is SGLang's --------------------------------------------------------


@pytest.mark.parametrize("gib", [(70, 66), (70, 63.1), (70, 62.9), (40, 80, 80), (80, 80)])
def test_balance_rule_agrees_with_sglangs_own_check(gib, monkeypatch):
    """``balance_problem`` refuses exactly when SGLang's ``_check_tp_memory_balance`` raises on
    some TP rank (its input: the group's lowest free memory and the rank's own, in GB)."""
    from tests.support.sglang_prelude import install

    install()
    from sglang.srt.distributed.bootstrap import _check_tp_memory_balance

    from hybridrl.rollout.sglang.balance import balance_problem

    monkeypatch.delenv("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", raising=False)
    refused = False
    for own in gib:
        try:
            _check_tp_memory_balance(pre_model_load_memory=min(gib), local_gpu_memory=own)
        except RuntimeError:
            refused = True
    members = list(range(len(gib)))
    problem = balance_problem(members, [int(g * 2**30) for g in gib])
    assert (problem is not None) == refused, (gib, problem)
    monkeypatch.setenv("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", "false")  # SGLang only warns
    assert balance_problem(members, [int(g * 2**30) for g in gib]) is None


def test_the_calls_the_adapter_makes_have_sglangs_signatures():
    import inspect

    from tests.support.sglang_prelude import install

    install()
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    flush = inspect.signature(TokenizerManager.flush_cache)
    assert "timeout_s" in flush.parameters  # the adapter awaits flush_cache(timeout_s=...)
    assert list(inspect.signature(TokenizerManager.auto_create_handle_loop).parameters) == ["self"]
