"""SGLang's real scheduler-side code on gloo ranks, behind the adapter, for CPU tests.

Contract (test-only; ``sglang_prelude.install()`` runs first):
- ``publish(kwargs)``: a real ``ServerArgs(**kwargs, device="cpu")`` (kwargs: what the adapter
  starts its engine with) becomes this process's SGLang config, as a scheduler's entry does
  (the CPU cannot run SGLang's full resolution; the config bags are projected from the record).
- ``tp_coordinator(tp_size)``: collective over the world; SGLang's own ``GroupCoordinator`` over
  consecutive blocks of ``tp_size`` ranks (gloo), published as this process's TP group with its
  ranks, as SGLang's ``initialize_model_parallel`` publishes them (which insists on world ==
  tp x pp, hence built here from its ``init_model_parallel_group``).
- ``SchedulerRank(model, tp, members, group)``: one gen-TP rank's scheduler: SGLang's
  ``SchedulerWeightUpdaterManager`` over SGLang's runner ``WeightUpdater`` of ``model``, with
  SGLang's ``TpModelWorker.deserialize_own_rank`` and its no-op memory saver. Non-source members
  ``start()`` a thread that serves requests the source sends over ``group`` (gloo, the members);
  ``call(req)`` on the source runs a request on every member and returns their outputs. Each
  request runs inside ``scoped_torch_reductions`` (a real scheduler is a separate process: its
  reductions patch must not leak into the trainer side sharing this process).
- ``InProcessEngine(bridge, **server_kwargs)``: the ``Engine`` the adapter drives on the source:
  builds the real ``ServerArgs`` from the adapter's keywords, answers ``release/resume_memory_
  occupation``, ``begin/end_weight_update`` and ``tokenizer_manager.update_weights_from_tensor``
  through the members' managers (payloads normalized as SGLang's tokenizer manager does,
  results merged with its ``FanOutCommunicator.merge_results``); ``flush_cache`` answers a real
  ``FlushCacheReqOutput`` (``flush_ok``).
"""

from __future__ import annotations

import asyncio
import threading
import types

import torch
import torch.distributed as dist

from hybridrl.rollout.sglang.env import scoped_torch_reductions


def publish(kwargs: dict):
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(**kwargs, device="cpu")
    runtime_context._CONTEXT.set_server_args(server_args)
    return server_args


def tp_coordinator(tp_size: int):
    """This rank's SGLang TP ``GroupCoordinator`` (collective; see the module docstring)."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import get_parallel

    world = dist.get_world_size()
    blocks = [list(range(i, i + tp_size)) for i in range(0, world, tp_size)]
    opts = dict(use_pynccl=False, use_custom_allreduce=False)
    tp = ps.init_model_parallel_group(blocks, 0, "gloo", group_name=f"tp{tp_size}", **opts)
    pp = ps.init_model_parallel_group([[r] for r in range(world)], 0, "gloo",
                                      group_name=f"pp{tp_size}", **opts)
    r = tp.rank_in_group
    get_parallel().override_permanently(
        tp_size=tp_size, tp_rank=r, pp_size=1, pp_rank=0, attn_tp_size=tp_size,
        attn_tp_rank=r, attn_dp_size=1, attn_dp_rank=0, attn_cp_size=1, attn_cp_rank=0,
        tp_group=tp, pp_group=pp, attn_tp_group=tp)
    return tp


class SchedulerRank:
    """See the module docstring."""

    def __init__(self, model, tp, members: list[int], group):
        from sglang.srt.managers import io_struct as io
        from sglang.srt.managers.scheduler_components.weight_updater import (
            SchedulerWeightUpdaterManager,
        )
        from sglang.srt.managers.tp_worker import TpModelWorker
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
        from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

        self.members, self.group, self.src = members, group, members[0]
        runner = types.SimpleNamespace(tp_rank=tp.rank_in_group, model=model)
        runner.weight_updater = WeightUpdater(
            tp_rank=tp.rank_in_group, device="cpu", gpu_id=0, model_config=None,
            custom_weight_loaders={}, get_model=lambda: model,
            update_model_fields=lambda **kw: None, recapture_cuda_graph=lambda: None,
            get_model_runner=lambda: runner)
        worker = types.SimpleNamespace(model_runner=runner)
        worker.deserialize_own_rank = types.MethodType(TpModelWorker.deserialize_own_rank, worker)
        worker.weight_update_runners = lambda: [("target", runner)]
        self.manager = SchedulerWeightUpdaterManager(
            tp_worker=worker, draft_worker=None, tp_cpu_group=tp.cpu_group,
            memory_saver_adapter=TorchMemorySaverAdapter.create(enable=False),
            flush_cache=lambda **kw: True, is_fully_idle=lambda **kw: True,
            scheduler=types.SimpleNamespace(_engine_paused=False, disaggregation_mode=None,
                                            record_weight_version_change=lambda **kw: None))
        m = self.manager
        self.routes = {io.UpdateWeightsFromTensorReqInput: m.update_weights_from_tensor,
                       io.BeginWeightUpdateReqInput: m.begin_weight_update,
                       io.EndWeightUpdateReqInput: m.end_weight_update,
                       io.ReleaseMemoryOccupationReqInput: m.release_memory_occupation,
                       io.ResumeMemoryOccupationReqInput: m.resume_memory_occupation}
        self.handled: list[str] = []
        self.thread = None

    def _handle(self, req):
        self.handled.append(type(req).__name__)
        with scoped_torch_reductions(lambda: None):
            return self.routes[type(req)](req)

    def start(self) -> None:
        if self.group is not None and dist.get_rank() != self.src:
            self.thread = threading.Thread(target=self._serve, daemon=True)
            self.thread.start()

    def _serve(self) -> None:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=self.src, group=self.group)
            if box[0] is None:
                return
            dist.gather_object(self._handle(box[0]), None, dst=self.src, group=self.group)

    def call(self, req) -> list:
        if self.group is None:
            return [self._handle(req)]
        dist.broadcast_object_list([req], src=self.src, group=self.group)
        out = self._handle(req)
        parts = [None] * len(self.members)
        dist.gather_object(out, parts, dst=self.src, group=self.group)
        return parts

    def stop(self) -> None:
        if self.group is not None and dist.get_rank() == self.src:
            dist.broadcast_object_list([None], src=self.src, group=self.group)
        if self.thread is not None:
            self.thread.join()


class _TokenizerManager:
    def __init__(self, bridge: SchedulerRank, engine=None):
        self.bridge, self.engine = bridge, engine

    async def update_weights_from_tensor(self, obj, request=None):
        from sglang.srt.managers.communicator import FanOutCommunicator
        from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads

        obj.serialized_named_tensors = normalize_serialized_named_tensor_payloads(
            obj.serialized_named_tensors)
        return FanOutCommunicator.merge_results(self.bridge.call(obj))

    async def flush_cache(self, timeout_s=None):
        return self.engine.flush_cache()


class InProcessEngine:
    """See the module docstring."""

    flush_ok = True

    def __init__(self, bridge: SchedulerRank, **kwargs):
        self.server_args = publish(kwargs)
        self.kwargs, self.bridge, self.calls = kwargs, bridge, []
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = _TokenizerManager(bridge, self)

    def _fan_out(self, req):
        from sglang.srt.managers.communicator import FanOutCommunicator

        self.calls.append(type(req).__name__)
        outs = self.bridge.call(req)
        return FanOutCommunicator.merge_results(outs) if hasattr(outs[0], "success") else None

    def release_memory_occupation(self, tags=None):
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        return self._fan_out(ReleaseMemoryOccupationReqInput(tags=tags))

    def resume_memory_occupation(self, tags=None):
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        return self._fan_out(ResumeMemoryOccupationReqInput(tags=tags))

    def begin_weight_update(self, selector: str = "all"):
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        return self._fan_out(BeginWeightUpdateReqInput(selector=selector))

    def end_weight_update(self):
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        return self._fan_out(EndWeightUpdateReqInput())

    def flush_cache(self):
        from sglang.srt.managers.io_struct import FlushCacheReqOutput

        self.calls.append("flush_cache")
        return FlushCacheReqOutput(success=self.flush_ok,
                                   message="" if self.flush_ok else "pending requests")


def nan_fill(model: torch.nn.Module) -> None:
    """Every parameter NaN: one the push does not write stays visibly wrong."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
