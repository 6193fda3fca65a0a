"""A process that starts an "engine" the way SGLang 0.5.21's ``Engine`` touches its own process,
behind the adapter's ``engine_start_env``, then has a child fail the way SGLang's scheduler does.

``python -m tests.support.sglang_signals MODEL_PATH`` (test-only; ``sglang_prelude.install()``
first), run by tests/unit/test_sglang_side_effects.py:
- inside ``engine_start_env(LABEL)``: SGLang's real ``configure_logger`` and
  ``_set_envs_and_config`` on a real ``ServerArgs`` with the adapter's
  ``custom_sigquit_handler`` (root-logger reset, env variables, its launch-phase SIGQUIT
  handler: the adapter's instead of the one that kills the process tree; the args pickle as
  they travel to the schedulers), then ``watch.contain`` on an engine
  whose tokenizer manager runs SGLang's real ``TokenizerManager.auto_create_handle_loop`` (its
  running-phase SIGQUIT and SIGTERM handlers on the event loop);
- prints ``STATE <json>``: what the process has afterwards (SIGTERM handler kept, root logger
  kept, SGLANG_* variables) and what a process spawned inside saw;
- then a spawned child signals its parent with SIGQUIT, as SGLang's scheduler does when it
  fails (``psutil``'s parent ``send_signal``); the main thread waits (sleeping, as a trainer
  waiting on the engine) and prints ``CAUGHT <line>`` and exits 1 on ``EngineDied``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
import types

LABEL = "rank 3: the SGLang engine of gen-TP group [3] (source rank 3)"


def _child_reads(queue) -> None:
    from tests.support.sglang_prelude import install

    install()
    from sglang.srt.environ import envs
    from sglang.srt.utils.common import get_bool_env_var

    queue.put({"environ": envs.SGLANG_MEMORY_SAVER_CUDA_GRAPH.get(),  # SGLang's two readers
               "get_bool_env_var": get_bool_env_var("SGLANG_MEMORY_SAVER_CUDA_GRAPH")})


def _child_fails() -> None:
    import psutil

    time.sleep(0.5)
    psutil.Process().parent().send_signal(signal.SIGQUIT)  # SGLang's scheduler, on failure


def _engine(real_tm_cls):
    async def idle():
        return None

    manager = types.SimpleNamespace(event_loop=None, asyncio_tasks=set(), handle_loop=idle,
                                    sigterm_watchdog=idle, _subprocess_watchdog=None)
    from sglang.srt.managers.tokenizer_manager import SignalHandler

    manager.signal_handler_class = SignalHandler
    manager.auto_create_handle_loop = types.MethodType(real_tm_cls.auto_create_handle_loop,
                                                       manager)
    return types.SimpleNamespace(loop=asyncio.new_event_loop(), tokenizer_manager=manager)


def main(model_path: str) -> int:
    from tests.support.sglang_prelude import install

    install()
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.common import configure_logger

    from hybridrl.rollout.sglang.env import EngineDied, engine_start_env

    def ours(signum, frame):  # the trainer's SIGTERM handler (hybridrl.train installs one)
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, ours)
    root = logging.getLogger()
    mine = logging.StreamHandler(sys.stderr)
    root.handlers[:] = [mine]
    root.setLevel(logging.WARNING)
    before = {k: v for k, v in os.environ.items() if k.startswith("SGLANG_")}
    with engine_start_env(LABEL) as watch:
        # the adapter's start keyword: SGLang's launch phase installs it instead of its own
        args = ServerArgs(model_path=model_path, skip_tokenizer_init=True, device="cpu",
                          custom_sigquit_handler=watch.sigquit)
        configure_logger(args)  # as Engine._launch_subprocesses runs them
        _set_envs_and_config(args)
        launch_handler_is_watch = signal.getsignal(signal.SIGQUIT) == watch.sigquit
        shipped = pickle.loads(pickle.dumps(args))  # what the spawned schedulers receive
        ships = shipped.custom_sigquit_handler.__self__.label == LABEL
        queue = mp.get_context("spawn").Queue()
        proc = mp.get_context("spawn").Process(target=_child_reads, args=(queue,))
        proc.start()
        seen = queue.get(timeout=120)
        proc.join()
        engine = _engine(TokenizerManager)
        watch.contain(engine)
        armed = engine.tokenizer_manager.event_loop is engine.loop
    after = {k: v for k, v in os.environ.items() if k.startswith("SGLANG_")}
    # the loop's own signal handlers are gone: no wakeup fd left through which SGLang's
    # running-phase handlers would run (and kill the tree) the next time the loop runs
    wakeup_free = signal.set_wakeup_fd(-1) == -1
    state = {"child": seen, "armed": armed, "sigterm_kept": signal.getsignal(signal.SIGTERM) is ours,
             "sigquit_is_watch": signal.getsignal(signal.SIGQUIT) == watch.sigquit,
             "root_kept": root.handlers == [mine] and root.level == logging.WARNING,
             "sglang_env_kept": after == before, "wakeup_free": wakeup_free,
             "launch_handler_is_watch": launch_handler_is_watch, "ships": ships}
    print("STATE " + json.dumps(state), flush=True)
    child = mp.get_context("spawn").Process(target=_child_fails)
    child.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)
    except EngineDied as err:
        print(f"CAUGHT {err}", flush=True)
        child.join()
        return 1
    print("NO SIGNAL", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
