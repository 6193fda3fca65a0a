"""``hybridrl plan --search``: the best layouts for a job by predicted step time.

Contract:
- ``candidates(world, shape, gpus_per_node, min_tokens)`` enumerates layouts as dicts of
  ``plan`` flags: training ``tp`` in 1, 2, 4, ... up to the node size (dividing the KV heads),
  ``pp`` 1, 2, 4 or 8 dividing the layers, with tp x pp dividing the training ranks; generation
  ``gen_tp`` (pg = 1: pipelined decode only adds latency here) dividing tp x pp, the KV heads
  and the node size; the placement: colocated, or split with ``gen_world`` of 1/4 or 1/2 of
  the world (whole nodes when the world has several; a multiple of gen_tp; ``--placement``
  keeps one of the two); the
  micro-batch budget ``max_tokens_per_gpu`` of 8k, 16k or 32k tokens (at least one sequence);
  and the memory knobs, from cheapest to leanest: nothing, selective recompute, full
  recompute (+ sequence parallel when tp > 1), then also offload of params, grads and optim.
- ``search(args, time_report)``: each candidate through ``time_report`` (the ``plan --memory``
  verdict and the prediction of the same code as ``plan --time``); those that do not fit are
  dropped, the rest sorted by ``step_s`` (to 10 ms; ties: the most memory headroom first); returns ``{"model", "world", "gpu", "evaluated",
  "fit", "best": [time reports]}`` with ``--top`` of them. Raises ValueError when none fits.
  For each layout and budget the knobs are tried from the cheapest and the first that fits is
  kept (a leaner knob only adds recompute FLOPs or PCIe copies in the model, never speed).
- Speed: the memory plan rebuilds the parameter specs per stage and part (``build_specs``,
  ``stage_counts``: pure functions of the frozen shape and sizes); the search memoizes them for
  its own duration (``_memoized_specs``). A generation layout whose weights M/tg and the fixed
  reserve alone exceed the GPU is skipped before planning (``plan --memory`` refuses it too:
  its engine phases hold both).
"""

from __future__ import annotations

import contextlib
import copy

KNOBS = ((("none", False, "")), ("selective", False, ""), ("full", True, ""),
         ("full", True, "params,grads,optim"))
BUDGETS = (8192, 16384, 32768)
SPLIT_SHARES = (1 / 4, 1 / 2)


def _powers(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def _split_sizes(world: int, gpus_per_node: int, gen_tp: int) -> list[int]:
    unit = gpus_per_node if world >= 2 * gpus_per_node else 1
    sizes = set()
    for share in SPLIT_SHARES:
        g = round(world * share / unit) * unit
        g -= g % gen_tp
        if 0 < g < world:
            sizes.add(g)
    return sorted(sizes)


def candidates(world: int, shape, gpus_per_node: int, min_tokens: int,
               max_gen_tp_bytes: float = float("inf")) -> list[dict]:
    """Layouts to try (see the module docstring); ``max_gen_tp_bytes``: the most bytes of
    engine weights a GPU can hold (smaller gen_tp are skipped)."""
    out = []
    weights = shape.num_params() * 2
    groups = shape.num_query_groups
    for tp in _powers(min(gpus_per_node, groups)):
        if groups % tp:
            continue
        for pp in [p for p in _powers(min(shape.layers, 8)) if shape.layers % p == 0]:
            for gen_tp in _powers(min(tp * pp, gpus_per_node, groups)):
                if (tp * pp) % gen_tp or groups % gen_tp or weights / gen_tp > max_gen_tp_bytes:
                    continue
                places = [("colocated", 0)] + [("split", g) for g in
                                               _split_sizes(world, gpus_per_node, gen_tp)]
                for placement, gen_world in places:
                    if (world - gen_world) % (tp * pp):
                        continue
                    for budget in BUDGETS:
                        if budget < min_tokens:
                            continue
                        for recompute, sp, offload in KNOBS:
                            out.append({"tp": tp, "pp": pp, "gen_tp": gen_tp, "gen_pp": 1,
                                        "placement": placement, "gen_world": gen_world,
                                        "max_tokens_per_gpu": budget, "recompute": recompute,
                                        "sp": sp and tp > 1, "offload": offload})
    return out


@contextlib.contextmanager
def _memoized_specs():
    """``planning.memory``'s ``build_specs`` and ``stage_counts`` (pure functions of hashable
    arguments) answered from dicts while the search runs."""
    from hybridrl.planning import memory

    originals = {name: getattr(memory, name) for name in ("build_specs", "stage_counts")}

    def memo(fn):
        seen = {}

        def cached(*args, **kwargs):
            key = (args, tuple(sorted(kwargs.items())))
            if key not in seen:
                seen[key] = fn(*args, **kwargs)
            return seen[key]
        return cached

    for name, fn in originals.items():
        setattr(memory, name, memo(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(memory, name, fn)


def search(args, time_report) -> dict:
    """The layouts that fit, best first (see the module docstring)."""
    from hybridrl.planning.cli import load_shape

    if args.world is None or args.world < 1:
        raise ValueError("--search needs --world")
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    if args.config:
        raise ValueError("--search takes the workload flags, not --config")
    shape = load_shape(args.model)
    prompt = int(args.prompt_len if args.prompt_len is not None else 512)
    max_resp = args.max_response_len if args.max_response_len is not None else 1024
    cache: dict = {}
    fits, evaluated = [], 0
    seen_hw, done = None, set()
    with _memoized_specs():
        from hybridrl.planning.hardware import GPUS
        from hybridrl.planning.memory import DTYPE_BYTES, RESERVE_BYTES

        gb = args.gpu_gb or (GPUS[args.gpu].hbm_bytes / 1e9 if args.gpu in GPUS else None)
        room = gb * 1e9 - RESERVE_BYTES if gb else float("inf")
        room = room * 2 / DTYPE_BYTES[args.dtype]  # candidates() counts 2-byte weights
        for cand in candidates(args.world, shape, args.gpus_per_node, prompt + max_resp, room):
            if args.placement and cand["placement"] != args.placement:
                continue
            frame = tuple(v for k, v in cand.items() if k not in ("recompute", "sp", "offload"))
            if frame in done:  # a cheaper knob of this layout and budget already fits
                continue
            a = copy.copy(args)
            a.search, a.time = False, True
            for k, v in cand.items():
                setattr(a, k, v)
            evaluated += 1
            try:
                rep = time_report(a, cache)
            except ValueError:  # a layout the planner refuses (e.g. a vocab it cannot split)
                continue
            seen_hw = rep["gpu"]
            if rep["memory"]["fits"]:
                fits.append(rep)
                done.add(frame)
    if not fits:
        raise ValueError(f"no layout of {evaluated} fits {args.world} x {args.gpu} "
                         f"({args.gpu_gb or 'default'} GB): more GPUs or a smaller workload")
    fits.sort(key=lambda r: (round(r["step_s"], 2), -r["memory"]["headroom_bytes"]))
    return {"model": args.model, "world": args.world, "gpu": seen_hw, "evaluated": evaluated,
            "fit": len(fits), "best": fits[:args.top]}
