"""Run a module-level function on N local gloo ranks and collect what each rank returns.

Contract:
- ``run_on_ranks(fn, world_size, *args, timeout=...)`` starts ``world_size`` processes with the
  multiprocessing "forkserver" context (fork hangs once the parent ran a matmul; spawn re-imports
  torch per process). The fork server preloads torch (and ``preload`` modules), so ranks start in
  well under a second each. Each rank joins a gloo default group on a free localhost port, sets
  one intra-op thread, calls ``fn(rank, world_size, *args)`` and sends back its return value
  (which must pickle; tensors are copied, so they may be returned as they are).
- Returns the per-rank results as a list indexed by rank. If any rank raises, the others are
  killed and ``RankFailure`` carries the first failing rank's traceback. If the ranks have not all
  finished within ``timeout`` seconds, all are killed and ``RankTimeout`` names the missing ranks.
- ``fn`` must be importable by its module path (define it at module level, not in a closure).
- ``preload`` takes effect only when the fork server starts (the first call in a process);
  later calls fork from the same server.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_PRELOAD = ("torch", "torch.distributed")


class RankFailure(RuntimeError):
    """A rank raised; the message holds its traceback."""


class RankTimeout(RuntimeError):
    """Not every rank finished in time."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world_size, port, args, results, threads):
    try:
        import datetime
        import warnings

        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
        )
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=300),
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # plain pickle copies tensor bytes; the queue's own pickler would share them by file
        # descriptor, which breaks once this process exits
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report everything, including SystemExit from user code
        results.put((rank, False, traceback.format_exc()))


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    preload: Sequence[str] = (),
    threads: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results by rank."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*DEFAULT_PRELOAD, *preload])
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, r, world_size, port, args, results, threads),
            name=f"rank{r}",
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, world_size, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)


def _collect(procs, results, world_size: int, timeout: float) -> list[Any]:
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(out) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(set(range(world_size)) - set(out))
            raise RankTimeout(f"ranks {missing} did not finish within {timeout:.0f} s")
        try:
            rank, ok, value = results.get(timeout=min(left, 1.0))
        except queue.Empty:
            # a rank flushes its result before it exits, so an empty queue and a dead rank mean
            # it died without reporting (segfault, OOM kill, os._exit)
            dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
            if dead:
                raise RankFailure(
                    f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result"
                ) from None
            continue
        if not ok:
            raise RankFailure(f"rank {rank} failed:\n{value}")
        out[rank] = pickle.loads(value)
    return [out[r] for r in range(world_size)]
