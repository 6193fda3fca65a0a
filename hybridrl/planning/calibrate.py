"""``hybridrl plan --calibrate``: measure this machine for ``plan --time --gpu cpu`` (seconds).

Contract:
- ``run_calibration(path=None)`` measures, with one torch thread per rank as the CPU ranks run:
  ``flops`` (fp32 matmul FLOP/s of a [256, 256] x [256, 256] product), ``memory_bps`` (bytes/s
  of copying a 64 MiB tensor, counted once read + once written); then hybridrl's own model at the
  CPU demo's size (4 layers of 64 hidden, vocabulary 100), built on a 1-rank gloo group in a
  child process, on packed micro-batches of ``SEQS`` = 2 and 8 sequences of ``SEQ_LEN`` = 72
  tokens (as the trainer packs them) through ``run_microbatches``: forward-only and forward +
  backward with the trainer's GRPO actor loss (``algos.losses.actor_loss``: clipped ratio and
  low-var KL), the fastest of each in ``FIT_ROUNDS`` rounds over the sizes in turn. Each pass
  is a straight line in its tokens: the forward's intercept over
  layers + 1 (the head and log-prob) is ``layer_latency_s`` (the fixed cost of one layer call
  per micro-batch), the training pass's intercept over the forward's is
  ``train_calls_per_forward``; the forward's slope less its FLOPs at ``flops`` is the
  activation traffic per token, ``act_passes`` = that many fp32 vectors of (layers x hidden +
  vocab) at ``memory_bps`` (unfused elementwise ops, norms, rotary, softmax: the work that does
  not shrink with the GEMMs' efficiency), and the training slope's (less 3x the FLOPs) over the
  forward's is ``train_act_ratio``. ``optimizer_latency_s``: megatron's optimizer step of that
  model through ``train_step``, less the forward + backward and the bytes Adam streams
  (``timing.OPTIMIZER_BYTES_PER_PARAM``): its fixed cost per step. ``dp_step_latency_s``: the
  same model on 2 ranks (dp 2, megatron's distributed optimizer, ``DP_STEPS`` steps of a
  ``SEQS[0]``-sequence micro-batch each): ``train_step`` less its forward + backward, less the
  dp-1 optimizer step and the 2 collectives the model counts (gradients' reduce-scatter,
  parameters' all-gather): the distributed optimizer's own fixed cost per step at dp > 1
  (bucket copies, shard bookkeeping). ``sample_latency_s``: one
  request's token drawn with its own generator, as the builtin engine samples (per request per
  decode step). ``torch_layer_latency_s`` (for comparison: the same layer's bare torch ops, 8
  tokens). Gloo between two local processes: ``collective_min_s`` (the fastest 8-byte
  all-reduce), ``link_bps`` (a 4 MiB all-reduce less that latency), ``collective_bench_s`` (for
  comparison: the mean all-reduce of 64 KiB after a little compute on each rank,
  ``RUN_COLLECTIVES`` times) and ``collective_latency_s``, one collective as a run meets it:
  the same model at tp 2 on the two ranks, the mean forward of ``SEQS[1]`` sequences
  (``DP_STEPS`` times) less what it computes as the model counts it (the layer calls, half the
  FLOPs, the activation traffic), over its 2 x layers + 5 collectives (``tp_collective_s``; at
  least the fastest): the waits for the other rank included, it grows with the machine's load.
  ``parallel_slowdown``: the time of a matmul loop on one rank while both of two ranks run it,
  over the same alone, in ``SLOWDOWN_ROUNDS`` alternating rounds (at least 1: what a second busy
  rank costs each on this machine as loaded; 1.0 quiet): a diagnostic of the load, not used by
  the model (the load comes and goes within seconds). ``cores``: the CPUs this process may run on (ranks past them share). ``memory_bytes`` (MemTotal). Writes them as JSON
  to ``path`` (default ``cache_path()``) with the host, CPU model and load, returns the dict.
- ``cache_path()``: ``$XDG_CACHE_HOME/hybridrl/plan-calibration-<host>.json`` (``~/.cache`` when
  the variable is unset): per machine, never in the repository.
- ``load_calibration(path=None)``: the cached dict; ValueError (one line) when there is none
  or it is unreadable, saying to run ``hybridrl plan --calibrate``.
- ``fit_model(timings, flops, memory_bps)``: the model's terms from ``_model_rank``'s timings
  (pure; the straight lines above); ``tp_collective_s(timings, fit, tp_forward_s, flops,
  memory_bps)``: the collective latency from the tp-2 forward (pure).
- ``calibrate_text(rep)``: the human form.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time

SEQ_LEN, SEQS = 72, (2, 8)  # the CPU demo's sequences (69-token prompts, 3-token responses)
RUN_COLLECTIVES = 40
SLOWDOWN_ROUNDS = 8
DP_STEPS = 15
FIT_ROUNDS = 5
KEYS = ("flops", "memory_bps", "layer_latency_s", "collective_latency_s", "link_bps",
        "memory_bytes")


def cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hybridrl", f"plan-calibration-{socket.gethostname()}.json")


def _best(fn, seconds: float = 0.4, at_least: int = 3) -> float:
    """The fastest of repeated calls of ``fn`` within about ``seconds``."""
    best, start, n = float("inf"), time.perf_counter(), 0
    while n < at_least or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn()
        best, n = min(best, time.perf_counter() - t0), n + 1
    return best


def _mean(fn, n: int) -> float:
    """The mean of ``n`` calls of ``fn``."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def _fixed(fn, n: int) -> float:
    """The fastest of exactly ``n`` calls of ``fn``."""
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _layer_flops(h: int, f: int, a: int, g: int, tokens: int) -> float:
    return tokens * 2.0 * (h * (a + 2 * g) + a * h + 3 * h * f) + 2.0 * a * tokens * tokens


def _layer_latency(flops: float) -> float:
    import torch
    import torch.nn.functional as fn

    h, f, heads, groups, tokens = 64, 128, 4, 2, 8
    hd = h // heads
    w = {"qkv": torch.randn(h, (heads + 2 * groups) * hd), "o": torch.randn(heads * hd, h),
         "fc1": torch.randn(h, 2 * f), "fc2": torch.randn(f, h)}
    x = torch.randn(1, tokens, h)

    def norm(t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5)

    def layer():
        with torch.no_grad():
            qkv = norm(x) @ w["qkv"]
            q, k, v = qkv.split([heads * hd, groups * hd, groups * hd], -1)
            q = q.view(1, tokens, heads, hd).transpose(1, 2)
            k = k.view(1, tokens, groups, hd).transpose(1, 2).repeat_interleave(2, 1)
            v = v.view(1, tokens, groups, hd).transpose(1, 2).repeat_interleave(2, 1)
            o = fn.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = x + o.transpose(1, 2).reshape(1, tokens, h) @ w["o"]
            gate, up = (norm(y) @ w["fc1"]).chunk(2, -1)
            return y + (fn.silu(gate) * up) @ w["fc2"]

    t = _best(layer)
    return max(t - _layer_flops(h, f, h, groups * hd, tokens) / flops, 0.0)


def _sample_latency() -> float:
    """Seconds per request per token of sampling with one generator per request (how the
    builtin engine samples so that a sequence does not depend on its batch): a multinomial
    draw over one row of 128 probabilities, 64 rows."""
    import torch

    rows = 64
    probs = torch.softmax(torch.randn(rows, 128), -1)
    gens = [torch.Generator().manual_seed(i) for i in range(rows)]

    def draw():
        return torch.cat([torch.multinomial(probs[b:b + 1], 1, generator=g)[:, 0]
                          for b, g in enumerate(gens)])
    return _best(draw) / rows


def _allreduce_rank(rank: int, store_path: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank,
                            world_size=2)
    small, big, act = torch.zeros(2), torch.zeros(1 << 20), torch.zeros(1 << 14)
    # compute alone (rank 1 waits in the barrier) and with both ranks computing at once: the
    # same matmul loop, rounds of each (the machine's other work comes and goes)
    y, alone, both = torch.randn(192, 192), 0.0, 0.0

    def work():
        for _ in range(40):
            y @ y
    for _ in range(SLOWDOWN_ROUNDS):
        alone += _mean(work, 4) if rank == 0 else 0.0
        dist.barrier()
        both += _mean(work, 4)
        dist.barrier()
    for _ in range(5):
        dist.all_reduce(small)
        dist.all_reduce(big)
    lat = _fixed(lambda: dist.all_reduce(small), 50)  # the same count on both ranks: every
    t_big = _fixed(lambda: dist.all_reduce(big), 10)  # call is a collective
    # as a run meets them: a micro-batch's activations (64 KiB) after a layer's worth of compute
    # on each rank; the mean, waits for the later rank included
    x, spent = torch.randn(128, 128), 0.0
    for _ in range(RUN_COLLECTIVES):
        for _ in range(4):
            x @ x
        t0 = time.perf_counter()
        dist.all_reduce(act)
        spent += time.perf_counter() - t0
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"lat": lat, "big": t_big, "bytes": big.numel() * 4,
                       "in_run": spent / RUN_COLLECTIVES, "slowdown": both / alone}, f)


def _collectives() -> dict:
    r = _spawn(_allreduce_rank, 2)
    # a 2-rank ring moves 2 (g-1)/g = 1 x the bytes each way
    bps = r["bytes"] / max(r["big"] - r["lat"], 1e-9)
    return {"collective_bench_s": max(r["in_run"], r["lat"]), "collective_min_s": r["lat"],
            "link_bps": bps, "parallel_slowdown": max(r["slowdown"], 1.0)}


def _model_rank(rank: int, store_path: str, out_path: str) -> None:
    """One rank (world 1): hybridrl's real model at the CPU demo's size (megatron's local spec
    with hybridrl's lean forwards), packed micro-batches of ``SEQS`` sequences of ``SEQ_LEN``
    tokens: forward-only log-probs and forward + backward with the PPO actor loss, each the
    fastest of repeated runs, and the optimizer step."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")  # megatron's notes on missing TE/Apex: not ours to show
    from hybridrl.algos.losses import actor_loss
    from hybridrl.config.model import ModelConfig
    from hybridrl.models.build import build_model
    from hybridrl.models.forward import run_microbatches
    from hybridrl.models.packing import pack_sequences
    from hybridrl.models.spec import LlamaSpec
    from hybridrl.models.train_step import ModelOptimizer, OptimConfig, train_step
    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 1), rank=0, world_size=1)
    try:
        spec = LlamaSpec.from_model_config(ModelConfig(vocab_size=100,
                                                       max_position_embeddings=128))
        model = build_model(spec, build_groups(TrainLayout(world=1)), "actor", dtype="fp32")

        def loss(out, batch):  # the trainer's GRPO actor loss: clipped ratio + low-var KL
            logp = out["logprobs"].reshape(1, -1)
            old = logp.detach()
            return actor_loss(old, logp, torch.ones_like(old), torch.ones_like(old),
                              ref_log_prob=old - 0.01, use_kl_loss=True)
        opt = ModelOptimizer(model, OptimConfig())
        rep, mbs = {}, {}
        for n in SEQS:
            ids, cu = pack_sequences([torch.randint(0, 100, (SEQ_LEN,)) for _ in range(n)])
            mbs[n] = mb = {"input_ids": ids, "cu_seqlens": cu}
            rep[f"fwd{n}"] = rep[f"train{n}"] = float("inf")
        for _ in range(FIT_ROUNDS):  # the sizes in turn: a load that comes and goes hits each
            for n, b in mbs.items():
                rep[f"fwd{n}"] = min(rep[f"fwd{n}"], _best(
                    lambda b=b: run_microbatches(model, [b]), 0.1, 2))
                rep[f"train{n}"] = min(rep[f"train{n}"], _best(lambda b=b: run_microbatches(
                    model, [b], loss_fn=loss, forward_only=False), 0.1, 2))
        rep["step"] = _best(lambda: train_step(model, opt, [mb], loss), 0.5, 5)
        rep.update(params=sum(p.numel() for p in model.module.parameters()),
                   layers=spec.num_layers, hidden=spec.hidden_size, ffn=spec.ffn_hidden_size,
                   heads=spec.num_attention_heads, groups=spec.num_query_groups,
                   vocab=spec.vocab_size)
        with open(out_path, "w") as f:
            json.dump(rep, f)
    finally:
        dist.destroy_process_group()


def _dp_rank(rank: int, store_path: str, out_path: str) -> None:
    """Two ranks (dp 2, the distributed optimizer): the same model's ``train_step`` on one
    micro-batch of ``SEQS[0]`` sequences per rank, the fastest of repeated runs."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    from hybridrl.config.model import ModelConfig
    from hybridrl.models.build import build_model
    from hybridrl.models.packing import pack_sequences
    from hybridrl.models.spec import LlamaSpec
    from hybridrl.models.train_step import ModelOptimizer, OptimConfig, train_step
    from hybridrl.parallel.groups import build_groups
    from hybridrl.parallel.layout import TrainLayout

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank,
                            world_size=2)
    try:
        spec = LlamaSpec.from_model_config(ModelConfig(vocab_size=100,
                                                       max_position_embeddings=128))
        model = build_model(spec, build_groups(TrainLayout(world=2)), "actor", dtype="fp32")
        opt = ModelOptimizer(model, OptimConfig())
        ids, cu = pack_sequences([torch.randint(0, 100, (SEQ_LEN,)) for _ in range(SEQS[0])])
        mb = {"input_ids": ids, "cu_seqlens": cu}

        def loss(out, batch):
            return out["logprobs"].mean(), {}
        step = _fixed(lambda: train_step(model, opt, [mb], loss), DP_STEPS)  # both ranks alike
        one = _fixed(lambda: _run_alone(model, mb, loss), DP_STEPS)
        # tp 2: forwards of a micro-batch of SEQS[1] sequences, the mean (waits included)
        from hybridrl.models.forward import run_microbatches

        tp = build_model(spec, build_groups(TrainLayout(world=2, tp=2)), "actor", dtype="fp32")
        ids, cu = pack_sequences([torch.randint(0, 100, (SEQ_LEN,)) for _ in range(SEQS[1])])
        big = {"input_ids": ids, "cu_seqlens": cu}
        for _ in range(3):
            run_microbatches(tp, [big])
        tp_fwd = _mean(lambda: run_microbatches(tp, [big]), DP_STEPS)
        dist.barrier()
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"step": step, "train": one, "tp_fwd": tp_fwd}, f)
    finally:
        dist.destroy_process_group()


def _run_alone(model, mb, loss) -> None:
    """The forward + backward of ``train_step`` without its optimizer step."""
    from hybridrl.models.forward import run_microbatches

    run_microbatches(model, [mb], loss_fn=loss, forward_only=False)


def _spawn(fn, nprocs: int) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.start_processes(fn, args=(os.path.join(tmp, "store"), out), nprocs=nprocs,
                           start_method="spawn")
        with open(out) as f:
            return json.load(f)


def _model_latency(flops: float, memory_bps: float, best_collective_s: float) -> dict:
    r1 = _spawn(_model_rank, 1)
    fit = fit_model(r1, flops, memory_bps)
    r = _spawn(_dp_rank, 2)
    lat = max(tp_collective_s(r1, fit, r["tp_fwd"], flops, memory_bps), best_collective_s)
    # dp 2: the optimizer step beyond the forward + backward, less the same at dp 1 and the two
    # collectives the model counts itself (gradients' reduce-scatter, parameters' all-gather)
    extra = r["step"] - r["train"] - fit["optimizer_latency_s"] - 2 * lat
    return {**fit, "collective_latency_s": lat, "dp_step_latency_s": max(extra, 0.0)}


def tp_collective_s(r: dict, fit: dict, tp_fwd: float, flops: float,
                    memory_bps: float) -> float:
    """One collective as a run meets it: the tp-2 forward of ``SEQS[1]`` sequences less what
    it computes (the layer calls, half the FLOPs, the activation traffic, as the model counts
    them), over its collectives (2 per layer, 5 more: embedding and vocab-parallel log-prob)."""
    from hybridrl.planning import flops as F
    from hybridrl.planning.timing import TRAIN_EXTRA_FWD
    from hybridrl.reshard.specs import LlamaShape

    shape = LlamaShape(hidden=r["hidden"], ffn=r["ffn"], heads=r["heads"],
                       num_query_groups=r["groups"], layers=r["layers"], vocab=r["vocab"])
    tokens = SEQS[1] * SEQ_LEN
    compute = (shape.layers + 1) * fit["layer_latency_s"] \
        + SEQS[1] * F.forward_flops(shape, SEQ_LEN) / (2 * flops) \
        + fit["act_passes"] * tokens * (shape.layers * shape.hidden + shape.vocab) * 4 \
        / memory_bps
    return (tp_fwd - compute) / (2 * shape.layers + 1 + TRAIN_EXTRA_FWD["actor"])


def fit_model(r: dict, flops: float, memory_bps: float) -> dict:
    """The model's costs beyond its FLOPs from the timings ``r`` of ``_model_rank`` (the
    module docstring): each pass a straight line in its tokens; its intercept is the layer
    calls, its slope beyond the FLOPs the activation traffic."""
    from hybridrl.planning import flops as F
    from hybridrl.planning.timing import OPTIMIZER_BYTES_PER_PARAM
    from hybridrl.reshard.specs import LlamaShape

    shape = LlamaShape(hidden=r["hidden"], ffn=r["ffn"], heads=r["heads"],
                       num_query_groups=r["groups"], layers=r["layers"], vocab=r["vocab"])
    (n1, n2), tok = SEQS, F.forward_flops(shape, SEQ_LEN) / SEQ_LEN / flops
    dt = (n2 - n1) * SEQ_LEN

    def line(kind: str) -> tuple[float, float]:
        slope = (r[f"{kind}{n2}"] - r[f"{kind}{n1}"]) / dt
        return r[f"{kind}{n1}"] - n1 * SEQ_LEN * slope, slope
    fwd_calls, fwd_slope = line("fwd")
    train_calls, train_slope = line("train")
    fwd_calls, extra = max(fwd_calls, 1e-9), max(fwd_slope - tok, 1e-12)
    vectors = (shape.layers * shape.hidden + shape.vocab) * 4  # fp32 bytes per pass
    optimizer = r["step"] - r[f"train{n2}"] - r["params"] * OPTIMIZER_BYTES_PER_PARAM \
        / memory_bps
    return {"layer_latency_s": fwd_calls / (shape.layers + 1),  # the head: one call more
            "train_calls_per_forward": max(train_calls / fwd_calls, 1.0),
            "act_passes": extra * memory_bps / vectors,
            "train_act_ratio": max(train_slope - 3 * tok, 0.0) / extra,
            "optimizer_latency_s": max(optimizer, 0.0)}


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def _mem_total() -> float:
    try:
        with open("/proc/meminfo") as f:
            return int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1]) * 1024.0
    except (OSError, StopIteration, ValueError):
        return 8e9


def run_calibration(path: str | None = None) -> dict:
    """Measure (see the module docstring), cache and return the figures."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    try:
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        flops = 2 * 256 ** 3 / _best(lambda: a @ b)
        src = torch.ones(1 << 24)  # 64 MiB of fp32
        memory_bps = 2 * src.numel() * 4 / _best(lambda: src.clone(), 0.5)
        op_layer = _layer_latency(flops)
        sample = _sample_latency()
    finally:
        torch.set_num_threads(threads)
    coll = _collectives()
    rep = {"flops": flops, "memory_bps": memory_bps, **coll,
           **_model_latency(flops, memory_bps, coll["collective_min_s"]),
           "sample_latency_s": sample, "torch_layer_latency_s": op_layer,
           "cores": _cores(), "memory_bytes": _mem_total(),
           "host": socket.gethostname(), "cpu": _cpu_model(),
           "load_avg": os.getloadavg()[0], "seconds": time.perf_counter() - t0,
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path = path or cache_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rep, f, indent=1)
    rep["path"] = path
    return rep


def load_calibration(path: str | None = None) -> dict:
    """The cached calibration of this machine (see the module docstring)."""
    path = path or cache_path()
    try:
        with open(path) as f:
            rep = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"--gpu cpu needs this machine's calibration ({path} is missing): "
                         "run `hybridrl plan --calibrate` first") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is unreadable ({err}): run `hybridrl plan --calibrate` "
                         "again") from None
    missing = [k for k in KEYS if not isinstance(rep.get(k), (int, float)) or rep[k] < 0]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}: run `hybridrl plan --calibrate` "
                         "again")
    return rep


def calibrate_text(rep: dict) -> str:
    return "\n".join([
        f"calibrated {rep['host']} ({rep['cpu']}) in {rep['seconds']:.1f} s at load "
        f"{rep['load_avg']:.1f}; cached in {rep['path']}",
        f"  matmul {rep['flops'] / 1e9:.2f} GFLOP/s per rank (one thread)",
        f"  memory copy {rep['memory_bps'] / 1e9:.2f} GB/s",
        f"  layer call {1e6 * rep['layer_latency_s']:.0f} us per micro-batch (a training "
        f"pass {rep['train_calls_per_forward']:.2f} of them)",
        f"  activation traffic {rep['act_passes']:.1f} vectors per token per layer beyond "
        f"the GEMMs (a training pass {rep['train_act_ratio']:.2f} x)",
        f"  optimizer step {1e3 * rep['optimizer_latency_s']:.2f} ms beyond its bytes, "
        f"{1e3 * rep['dp_step_latency_s']:.2f} ms more at dp > 1",
        f"  sampling {1e6 * rep['sample_latency_s']:.1f} us per request per token",
        f"  gloo collective {1e6 * rep['collective_latency_s']:.0f} us in the model at tp 2 "
        f"(an all-reduce alone: best {1e6 * rep['collective_min_s']:.0f} us, after compute "
        f"{1e6 * rep['collective_bench_s']:.0f} us), {rep['link_bps'] / 1e9:.2f} GB/s; "
        f"{rep['cores']} cores, two busy ranks {rep['parallel_slowdown']:.2f} x slower each"])
