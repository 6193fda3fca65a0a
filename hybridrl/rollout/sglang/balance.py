"""Balanced memory at an SGLang engine's start: what each gen-TP member has free, and whether
SGLang would start on it.

Contract (no SGLang import; SGLang 0.5.21's facts): SGLang sizes its KV pool from the lowest free
GPU memory over its TP ranks and, while ``SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK`` is on (its
default), refuses to start when a rank's lowest-over-the-group reading is under 90 % of its own
(``BALANCE``), i.e. when min < 0.9 x max over the members.
- ``free_memory(device, measure=None)``: empties this rank's CUDA cache (the trainer's cached
  blocks are not free to SGLang's processes), then its free bytes (``measure(device)`` when
  given, else ``torch.cuda.mem_get_info``; None on a CPU device).
- ``start_line(members, free)``: the source's start-up line, each member's free GiB.
- ``balance_problem(members, free)``: None when SGLang would start, else the one-line reason
  naming each member's free memory (unknown readings are left out).
- ``release_check(members, before, started, released)``: the source GPU's free bytes before
  the start, once started and after the first release -> (line, ok): what the engine took and
  gave back; ok is False when less than ``GIVEN_BACK`` of it came back (e.g. CUDA graphs kept
  out of the memory saver: ``SGLANG_MEMORY_SAVER_CUDA_GRAPH`` not in force). None without
  readings (a CPU device) or when the start took nothing measurable.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

GIB = 1 << 30
BALANCE = 0.9  # SGLang: a TP rank with less than 90 % of another's free memory refuses to start
BALANCE_CHECK = "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"  # SGLang's switch (default on)
GIVEN_BACK = 0.9  # the first release must give back at least this share of what the start took


def free_memory(device: torch.device, measure: Callable | None = None) -> int | None:
    """Free bytes on this rank's GPU after emptying its CUDA cache (None on a CPU device);
    ``measure(device)`` replaces the driver's reading (tests)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if measure is not None:
        return measure(device)
    return int(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else None


def _cells(members: list[int], free: list) -> str:
    return ", ".join(f"rank {r} {f / GIB:.1f} GiB" if f is not None else f"rank {r} -"
                     for r, f in zip(members, free))


def start_line(members: list[int], free: list) -> str:
    """The source's start-up line: each member's free GPU memory."""
    return (f"SGLang engine of gen-TP group {members}: free GPU memory at start "
            f"{_cells(members, free)} (SGLang sizes the KV pool from the lowest)")


def balance_problem(members: list[int], free: list) -> str | None:
    """Why SGLang would refuse to start on these members' free memory (None: it starts)."""
    known = [f for f in free if f is not None]
    check = os.environ.get(BALANCE_CHECK, "true").strip().lower() not in ("0", "false", "no",
                                                                          "n", "off")
    if not check or len(known) < 2 or min(known) >= BALANCE * max(known):
        return None
    return (f"free GPU memory differs by more than {1 - BALANCE:.0%} across gen-TP group "
            f"{members} ({_cells(members, free)}): "
            f"SGLang refuses to start ({BALANCE_CHECK}); another process holds memory on the "
            f"lower GPU(s), or a training part is still resident there")


def release_check(members: list[int], before, started, released) -> tuple[str, bool] | None:
    """What the engine took at start and gave back at its first release (module docstring)."""
    if None in (before, started, released) or before - started <= 0:
        return None
    taken, back = before - started, released - started
    line = (f"SGLang engine of gen-TP group {members}: took {taken / GIB:.1f} GiB of the source "
            f"GPU at start, gave back {back / GIB:.1f} GiB on release")
    if back >= GIVEN_BACK * taken:
        return line, True
    return (f"{line}: {(taken - back) / GIB:.1f} GiB stayed on the GPU through training (CUDA "
            f"graphs outside the memory saver? SGLANG_MEMORY_SAVER_CUDA_GRAPH)"), False
