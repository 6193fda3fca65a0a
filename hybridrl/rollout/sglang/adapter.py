"""``SGLangEngine``: one ``sglang.Engine`` per gen-TP group, fed by the reshard (GPU; lazy import).

Contract (docs/rollout.md has the diagram, the lifecycle and the memory of each phase):
- ``build_sglang_engine(...)`` is collective over the world (every rank, same arguments; the
  gen-TP groups ``all_members`` in the same order everywhere). It checks the SGLang/torch pair
  (``hybridrl.rollout.sglang.compat``), refuses ``engine_kwargs`` that set what the layout decides
  (``RESERVED``), creates gloo side groups (one per gen-TP group, whose timeout is
  ``rollout.timeout_s``; one over the world whose timeout is ``rollout.engine_start_timeout_s``),
  exchanges (host, local GPU, free GPU memory) of every rank and places each engine with
  ``gpu_placement``:
  ``base_gpu_id`` = its source rank's local GPU, ``gpu_id_step`` = the stride of its members'
  GPUs (SGLang puts TP rank k on GPU base + k x step, so members must be listed in that order),
  ``port`` = ``engine_port_base`` + 16 x base_gpu_id (distinct on a node), ``nccl_port`` = port
  + 1. Balanced memory: SGLang sizes the KV pool from the lowest free memory over its TP ranks
  and (by default) refuses to start when a rank has less than 90 % of another's. So before the
  exchange every rank empties its CUDA cache (always, offload flags or not) and reads its free
  memory (``backend.free_memory``, else ``torch.cuda.mem_get_info``; None on a CPU device); the
  exchange is the barrier: no source starts before every member emptied its cache (hybridrl/
  rollout/sglang/balance.py). The source logs ``start_line`` (each member's free GiB), then
  after its first release ``release_line`` (what the start took of its GPU and what the release
  gave back; a warning when under 90 % came back: the check that the CUDA graphs went under
  the memory saver took effect), and refuses, as a start failure, a group whose lowest free
  memory is under 90 % of its highest while SGLang's check is on
  (``SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK``, default on). The source rank starts the engine
  inside ``engine_start_env(label)`` (hybridrl/rollout/sglang/env.py: no torchrun agent-store
  flag, ``SGLANG_MEMORY_SAVER_CUDA_GRAPH=1`` so CUDA graphs are released with the engine; the
  trainer's NCCL/CUDA/SGLANG variables, root logger and SIGTERM handler restored afterwards,
  SGLang's event-loop signal handlers taken off, SIGQUIT -> ``EngineDied`` naming the engine,
  already during the launch: ``custom_sigquit_handler``, so a scheduler failing at start is a
  start failure on every rank, not a SIGKILL of the process tree) with
  ``load_format="dummy"`` (the first sync writes every weight), ``enable_memory_saver=True``,
  ``skip_tokenizer_init=True``, ``mem_fraction_static`` = ``rollout.mem_fraction_static``,
  ``enable_deterministic_inference`` = ``rollout.deterministic``, the training dtype, then any
  ``engine_kwargs`` (which may override these), and releases its memory. A MoE model adds
  ``loader.start_kwargs`` (refusing, in one line, ``loader.engine_kwargs_problem``). Every rank
  then learns over the world side group whether all engines started: a failure (or no answer
  within the start timeout) raises RuntimeError with the same one line on every rank.
- Lifecycle (the source rank calls the engine; the others wait on the side group, at most
  ``rollout.timeout_s`` per wait, then RuntimeError naming the engine): ``start_update(plan)``
  empties every member's CUDA cache, then (after a release) resumes the weights' memory and
  opens the weight-update session where the release has one; ``update_weights(named)`` is the
  reshard's sink at every flush (``WeightPusher`` rounds, load_format "direct", a MoE model's
  ``loader.LOADER``; tensors serialized with SGLang's reductions patch in force only around
  CUDA tensors: ``hybridrl.rollout.sglang.env.sglang_serializer``); ``finish_update()``
  empties every member's CUDA cache again (the reshard's buffers), closes the session,
  resumes the KV cache and CUDA graphs and flushes the cache (a failed flush raises); ``generate``; ``release()`` first awaits SGLang's
  ``flush_cache(timeout_s)`` (the scheduler defers it until it is fully idle, at most
  ``timeout_s`` = half of ``rollout.timeout_s``, so the members' waits outlast it), then gives
  all the engine's GPU memory back before the training phases: SGLang asserts the scheduler is
  idle in ``release_memory_occupation`` and a failed assertion kills the scheduler; a flush that
  times out raises on every rank instead, naming the engine. Order per step: resume -> update
  -> flush -> generate -> flush (idle) -> release.
- ``generate(prompt_ids, params)``: one sampling-params dict per request: max_new_tokens,
  temperature, top_p, top_k, ``stop_token_ids`` = [eos] when known and ``sampling_seed`` =
  ``request_seed(params.seed, i)`` (distinct for the n samples of a prompt), or
  ``params.row_seeds[i]`` when the caller gives one seed per request. The pinned releases
  honour ``sampling_seed`` only with deterministic inference (``seeds_honoured``); otherwise the
  seeds travel but sampling is not reproducible per request. The source's result (or its error)
  is broadcast over the gloo side group, never NCCL.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist

from hybridrl.rollout.base import GenerationOutput, SamplingParams, as_prompt_lists
from hybridrl.rollout.sampling import request_seed
from hybridrl.rollout.sglang.balance import (
    balance_problem,
    free_memory,
    release_check,
    start_line,
)
from hybridrl.rollout.sglang.compat import (
    LOAD_FORMAT,
    has_weight_update_session,
    import_sglang,
    not_importable,
)
from hybridrl.rollout.sglang.env import engine_start_env, sglang_serializer
from hybridrl.rollout.sglang.layout import engine_param_shapes
from hybridrl.rollout.sglang.loader import LOADER, engine_kwargs_problem, start_kwargs
from hybridrl.rollout.sglang.push import WeightPusher, bounded

logger = logging.getLogger(__name__)

RESERVED = ("model_path", "tp_size", "base_gpu_id", "gpu_id_step")  # the layout decides these
PORT_STRIDE = 16
FLUSH_SHARE = 0.5  # the idle flush before a release waits at most this share of timeout_s
REST = ["kv_cache", "cuda_graph"]  # memory tags resumed after the weights (SGLang's constants)


def gpu_placement(gpus: list[tuple[str, int]]) -> tuple[int, int]:
    """(base_gpu_id, gpu_id_step) of an engine whose TP ranks sit on ``gpus`` [(host, gpu)]
    in gen-TP order; ValueError unless they share one host at a constant GPU stride."""
    hosts = {h for h, _ in gpus}
    if len(hosts) != 1:
        raise ValueError(f"a gen-TP group must sit on one node (SGLang's Engine spans one "
                         f"host here); its ranks are on {sorted(hosts)}")
    ids = [g for _, g in gpus]
    step = ids[1] - ids[0] if len(ids) > 1 else 1
    if step < 1 or any(b - a != step for a, b in zip(ids, ids[1:])):
        raise ValueError(f"the GPUs of a gen-TP group, in gen-TP order, must be ascending and "
                         f"evenly spaced (SGLang puts TP rank k on base_gpu_id + k * "
                         f"gpu_id_step); got {ids}")
    return ids[0], step


@dataclasses.dataclass(frozen=True)
class SGLangBackend:
    """What the adapter takes from SGLang: tests pass fakes with the pinned signatures."""

    engine_cls: type  # sglang.Engine
    request_cls: type  # sglang.srt.managers.io_struct.UpdateWeightsFromTensorReqInput
    serialize: Callable  # [(name, tensor)] -> bytes (MultiprocessingSerializer)
    version: str
    free_memory: Callable | None = None  # device -> free bytes (tests); None: the CUDA driver's


def sglang_backend() -> SGLangBackend:
    """The installed SGLang (version-checked); ImportError with the install command."""
    from importlib import metadata

    sglang = import_sglang()
    try:  # the top-level package imports with fewer dependencies than these modules
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError as err:
        raise not_importable(err) from None

    # CUDA tensors pickle by device UUID (as the schedulers expect) only while serialized here
    serialize = sglang_serializer(MultiprocessingSerializer.serialize,
                                  monkey_patch_torch_reductions)
    return SGLangBackend(sglang.Engine, UpdateWeightsFromTensorReqInput, serialize,
                         metadata.version("sglang"))


def _gloo_groups(all_members: list[list[int]], rank: int, rollout):
    """(this rank's gen-TP gloo group or None, world gloo group); same calls on every rank."""
    mine = None
    for ranks in all_members:
        if len(ranks) > 1:
            g = dist.new_group(ranks, backend="gloo",
                               timeout=datetime.timedelta(seconds=rollout.timeout_s))
            mine = g if rank in ranks else mine
    world = dist.new_group(backend="gloo",
                           timeout=datetime.timedelta(seconds=rollout.engine_start_timeout_s))
    return mine, world


def engine_start_kwargs(model_path: str, *, tp_size: int, base: int, step: int,
                        dtype: torch.dtype, rollout, moe: bool = False) -> dict:
    """The ServerArgs keywords the source rank starts its engine with (module docstring)."""
    port = rollout.engine_port_base + PORT_STRIDE * base
    kwargs = dict(model_path=model_path, tp_size=tp_size, base_gpu_id=base, gpu_id_step=step,
                  port=port, nccl_port=port + 1, load_format="dummy", enable_memory_saver=True,
                  skip_tokenizer_init=True, mem_fraction_static=rollout.mem_fraction_static,
                  enable_deterministic_inference=rollout.deterministic,
                  dtype=str(dtype).removeprefix("torch."))
    kwargs.update(rollout.engine_kwargs)
    if moe:
        kwargs.update(start_kwargs(rollout.engine_kwargs))
    return kwargs


def build_sglang_engine(model_path: str, *, shape, all_members: list[list[int]], rank: int,
                        device, dtype: torch.dtype, rollout, backend: SGLangBackend | None = None,
                        groups: tuple | None = None):
    """Collective: start one engine per gen-TP group (see the module docstring). ``groups``:
    (this rank's gen-TP gloo group or None, a gloo group over every rank of ``all_members``)
    made by the caller (a split placement's ``gen_tp_gloo`` / ``gen_gloo``: its generation
    ranks cannot create groups on their own); then the call is collective over those ranks
    only and creates no group."""
    bad = sorted(set(rollout.engine_kwargs) & set(RESERVED))
    if bad:
        raise ValueError(f"rollout.engine_kwargs must not set {bad}: the gen layout decides "
                         f"{list(RESERVED)}")
    moe = bool(shape.num_experts)
    problem = engine_kwargs_problem(rollout.engine_kwargs) if moe else None
    if problem:
        raise ValueError(problem)
    backend = backend or sglang_backend()
    members = next(m for m in all_members if rank in m)
    table = engine_param_shapes(shape, len(members))
    tp_group, world_group = groups or _gloo_groups(all_members, rank, rollout)
    ranks = sorted(r for m in all_members for r in m) if groups else None
    index = {r: i for i, r in enumerate(ranks)} if ranks else None
    device = torch.device(device)
    local = device.index if device.type == "cuda" else int(os.environ.get("LOCAL_RANK", rank))
    mine = (socket.gethostname(), local, free_memory(device, backend.free_memory))
    gathered: list = [None] * (len(ranks) if ranks else dist.get_world_size())
    # the barrier of the start: every rank has emptied its cache before any engine starts
    dist.all_gather_object(gathered, mine, group=world_group)
    gpus = {r: gathered[index[r] if index else r] for m in all_members for r in m}
    placements = [gpu_placement([gpus[r][:2] for r in m]) for m in all_members]  # all alike
    base, step = placements[all_members.index(members)]
    engine, error, checked = None, None, None
    label = (f"rank {rank}: the SGLang engine of gen-TP group {members} (source rank "
             f"{members[0]})")
    if rank == members[0]:
        kwargs = engine_start_kwargs(model_path, tp_size=len(members), base=base, step=step,
                                     dtype=dtype, rollout=rollout, moe=moe)
        free = [gpus[r][2] for r in members]
        logger.info(start_line(members, free))
        try:
            problem = balance_problem(members, free)
            if problem:
                raise RuntimeError(problem)
            with engine_start_env(label) as watch:
                # SGLang installs this SIGQUIT handler for its launch phase instead of its own
                # (which SIGKILLs the process tree when a scheduler fails while starting)
                engine = backend.engine_cls(**{"custom_sigquit_handler": watch.sigquit,
                                               **kwargs})
                watch.contain(engine)
            started = free_memory(device, backend.free_memory)
            engine.release_memory_occupation()  # training runs first; sync resumes it
            checked = release_check(members, free[0], started,
                                    free_memory(device, backend.free_memory))
            if checked:  # the check that the graphs went under the memory saver took effect
                (logger.info if checked[1] else logger.warning)(checked[0])
        except Exception as err:  # any start failure is reported on every rank below
            line = (str(err).splitlines() or [repr(err)])[0]
            error = f"rank {rank}: the SGLang engine failed to start: {type(err).__name__}: {line}"
    errors: list = [None] * len(gathered)
    try:
        dist.all_gather_object(errors, error, group=world_group)
    except RuntimeError:
        raise RuntimeError(f"rank {rank}: not every SGLang engine started within "
                           f"rollout.engine_start_timeout_s={rollout.engine_start_timeout_s}") from None
    first = next((e for e in errors if e), None)
    if first:
        raise RuntimeError(first)
    handle = SGLangEngine(engine, backend, rank=rank, members=members, tp_group=tp_group,
                          table=table, dtype=dtype, device=device, timeout_s=rollout.timeout_s,
                          load_format=LOADER if moe else LOAD_FORMAT)
    handle.start_line = start_line(members, [gpus[r][2] for r in members])
    handle.release_line = checked[0] if rank == members[0] and checked else ""
    handle.seeds_honoured = bool(rollout.engine_kwargs.get("enable_deterministic_inference",
                                                           rollout.deterministic))
    if handle.is_src and not handle.seeds_honoured:
        logger.info("SGLang engine of gen-TP group %s: rollout.deterministic is off, so SGLang "
                    "%s ignores per-request sampling seeds", members, backend.version)
    return handle


class SGLangEngine:
    """One gen-TP rank's handle on its group's engine (the source holds ``engine``)."""

    def __init__(self, engine, backend: SGLangBackend, *, rank: int, members: list[int],
                 tp_group, table: dict, dtype: torch.dtype, device=None,
                 timeout_s: float = 3600.0, load_format: str = LOAD_FORMAT):
        self.engine, self.backend, self.rank, self.members = engine, backend, rank, members
        self.load_format = load_format
        self.tp_group, self.is_src = tp_group, rank == members[0]
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.sessions = has_weight_update_session(backend.version)
        self.flush_timeout_s = FLUSH_SHARE * timeout_s
        self.start_line = self.release_line = ""
        self.released = True
        self.seeds_honoured = False
        self.wait_label = (f"rank {rank}: waiting on the SGLang engine of gen-TP group {members} "
                           f"(source rank {members[0]}, rollout.timeout_s={timeout_s:g})")
        self.pusher = WeightPusher(rank, members, tp_group, table, dtype, backend.serialize,
                                   self._load, self.wait_label)

    def _empty_cache(self) -> None:
        """Every member gives its allocator's cached blocks back before the engine resumes
        memory on its GPU (the trainer's caching allocator would otherwise keep them)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._share(None)  # the source resumes only once every member has emptied its cache

    def _load(self, payloads: list) -> tuple[bool, str]:
        req = self.backend.request_cls(serialized_named_tensors=payloads,
                                       load_format=self.load_format, flush_cache=False)
        ok, message = self.engine.loop.run_until_complete(
            self.engine.tokenizer_manager.update_weights_from_tensor(req, None))
        return bool(ok), str(message)

    def start_update(self, plan) -> None:
        """Before the reshard: weights' memory back, session open (source); schedule rounds."""
        self.pusher.start(plan)
        if self.released:
            self._empty_cache()
        if self.is_src:
            try:
                if self.released:
                    self.engine.resume_memory_occupation(tags=["weights"])
                if self.sessions:
                    ok, message = _pair(self.engine.begin_weight_update())
                    if not ok:
                        raise RuntimeError(f"begin_weight_update failed: {message}")
            except Exception as err:  # reported in the first round, on every rank
                self.pusher.src_error = f"{type(err).__name__}: {err}"

    def update_weights(self, named_tensors) -> None:
        """The reshard's sink, called at every flush (one push round each)."""
        self.pusher.sink(named_tensors)

    def finish_update(self) -> None:
        """After the reshard: last rounds, session closed, KV cache resumed, cache flushed."""
        # after the last round, every member gives the reshard's buffers back before the KV
        # cache comes back
        self.pusher.finish(self._close if self.is_src else None,
                           self._empty_cache if self.released else None)
        self.released = False

    def _close(self) -> tuple[bool, str]:
        try:
            if self.sessions:
                ok, message = _pair(self.engine.end_weight_update())
                if not ok:
                    return False, f"end_weight_update failed: {message}"
            if self.released:
                self.engine.resume_memory_occupation(tags=REST)
            ok, message = self._flush()
            if not ok:
                return False, f"flush_cache failed: {message}"
        except Exception as err:
            return False, f"{type(err).__name__}: {err}"
        return True, ""

    def _flush(self) -> tuple[bool, str]:
        """SGLang's flush_cache, deferred by the scheduler until it is fully idle (bounded)."""
        manager = self.engine.tokenizer_manager
        return _pair(self.engine.loop.run_until_complete(
            manager.flush_cache(timeout_s=self.flush_timeout_s)))

    def release(self) -> None:
        """Once the scheduler is idle (bounded flush), give the engine's GPU memory back
        (weights, KV cache, CUDA graphs) before training."""
        result = (True, "")
        if self.is_src and not self.released:
            try:
                ok, message = self._flush()
                if not ok:
                    result = (False, f"rank {self.rank}: the SGLang engine of gen-TP group "
                              f"{self.members}: its scheduler was not idle within "
                              f"{self.flush_timeout_s:g} s after generate (flush_cache: "
                              f"{message or 'failed'}); its memory was not released")
                else:
                    self.engine.release_memory_occupation()
            except Exception as err:
                result = (False, f"release_memory_occupation failed: {type(err).__name__}: {err}")
        ok, message = self._share(result)
        self.released = True
        if not ok:
            raise RuntimeError(message)

    def _share(self, obj):
        if self.tp_group is None:
            return obj
        box = [obj]
        bounded(lambda: dist.broadcast_object_list(box, src=self.members[0], group=self.tp_group),
                self.wait_label)
        return box[0]

    def generate(self, prompt_ids, params: SamplingParams) -> GenerationOutput:
        prompts = as_prompt_lists(prompt_ids)
        result = None
        if self.is_src:
            try:
                outs = self.engine.generate(input_ids=prompts,
                                            sampling_params=sampling_dicts(params, len(prompts)),
                                            return_logprob=True)
                result = _to_output(outs, params)
            except Exception as err:  # every rank raises the source's error
                result = f"rank {self.rank}: SGLang generate failed: {type(err).__name__}: {err}"
        result = self._share(result)
        if isinstance(result, str):
            raise RuntimeError(result.splitlines()[0])
        return result


def _pair(result) -> tuple[bool, str]:
    """SGLang's (success, message) answers; a bare None counts as success."""
    if result is None:
        return True, ""
    if isinstance(result, tuple):
        return bool(result[0]), str(result[1]) if len(result) > 1 else ""
    return bool(getattr(result, "success", True)), str(getattr(result, "message", ""))


def sampling_dicts(params: SamplingParams, n: int) -> list[dict]:
    """One SGLang sampling-params dict per request, each with its own seed."""
    base = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "top_k": params.top_k}
    if params.stop_ids:
        base["stop_token_ids"] = list(params.stop_ids)
    seeds = params.row_seeds or [request_seed(params.seed, i) for i in range(n)]
    return [{**base, "sampling_seed": int(seed) % (2**63 - 1)} for seed in seeds]


def _to_output(outs: list[dict], params: SamplingParams) -> GenerationOutput:
    """SGLang's per-request dicts -> right-padded tensors."""
    ids = [list(o["output_ids"]) for o in outs]
    logps = [[float(t[0]) for t in o["meta_info"]["output_token_logprobs"]] for o in outs]
    R = max(1, max(len(r) for r in ids))
    out_ids = torch.full((len(ids), R), params.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(ids), R, dtype=torch.long)
    logp = torch.zeros(len(ids), R, dtype=torch.float32)
    for b, (r, lp) in enumerate(zip(ids, logps)):
        out_ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[b, : len(r)] = 1
        logp[b, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return GenerationOutput(out_ids, mask, logp)
