"""Adapter around ``sglang.Engine`` for GPU rollouts (imported lazily; needs the ``gpu`` extra).

Contract (tested here only up to the missing-import error: this machine cannot install SGLang):
- ``SGLangEngine(model_path, tp_group, tp_src, **engine_kwargs)``: every rank of one gen TP
  group constructs it; only the group's first rank (``tp_src``) starts ``sglang.Engine(
  model_path=..., tp_size=<group size>, **engine_kwargs)`` (``rollout.engine_kwargs`` pass
  through, e.g. ``mem_fraction_static``). Without sglang: ``ImportError`` saying how to install.
- ``update_weights(named_tensors)``: the tensors are this rank's engine-format shard
  (``hybridrl.reshard.formats.engine_format``, the same per-rank packing SGLang's models use).
  It only buffers them locally (no collective): the reshard calls it once per non-empty bucket,
  and ranks of one gen TP group see different numbers of buckets (e.g. 15 vs 14), so a
  collective per call would be unmatched and hang.
- ``finish_update()`` (every rank of the gen TP group, exactly once per sync): each rank
  serializes its buffered list (``MultiprocessingSerializer``: CUDA IPC handles, no copy), the
  source rank gathers the per-rank payloads with ONE ``gather_object`` and calls
  ``update_weights_from_tensor`` with ``load_format=DIRECT_LOADER``, SGLang's loader that copies
  tensors by name into the rank's parameters without re-splitting them (they are already the
  rank's shard). Cost: the rank's whole engine-format gen shard stays alive until this call.
- ``generate(prompt_ids, params)``: the source rank calls ``Engine.generate(input_ids=...,
  sampling_params=..., return_logprob=True)`` and broadcasts the ``GenerationOutput`` to the
  group. Per-token log-probs are SGLang's ``output_token_logprobs``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from hybridrl.rollout.base import GenerationOutput, SamplingParams, as_prompt_lists

DIRECT_LOADER = "sglang.srt.model_executor.model_runner._model_load_weights_direct"


def import_sglang():
    """``sglang`` or an ImportError with the fix."""
    try:
        import sglang
    except ImportError as err:
        raise ImportError(
            "rollout.engine=sglang needs SGLang, which is not installed here "
            f"({err.__class__.__name__}: {err}); install the GPU extra on a CUDA machine "
            "(pip install -e '.[gpu]') or use rollout.engine=builtin") from None
    return sglang


class GatheredUpdates:
    """Per-sync weight buffer of one gen TP rank: ``add`` is local, ``gather`` is the one
    collective (``gather_object`` to ``tp_src``); no SGLang needed (tested on gloo)."""

    def __init__(self, tp_group=None, tp_src: int = 0, tp_size: int = 1):
        self.tp_group, self.tp_src, self.tp_size = tp_group, tp_src, tp_size
        self.pending: list[tuple[str, torch.Tensor]] = []

    def add(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.pending.extend(named_tensors)  # keeps the tensors alive until ``gather``

    def gather(self, serialize) -> list | None:
        """Every rank: its payload ``serialize(pending)`` -> list of payloads on ``tp_src``
        (in group-rank order), None elsewhere; empties the buffer."""
        payload, self.pending = serialize(self.pending), []
        if self.tp_size == 1:
            return [payload]
        is_src = dist.get_rank() == self.tp_src
        gathered = [None] * self.tp_size if is_src else None
        dist.gather_object(payload, gathered, dst=self.tp_src, group=self.tp_group)
        return gathered


class SGLangEngine:
    """One gen TP group's SGLang engine; see the module docstring."""

    def __init__(self, model_path: str, *, tp_group=None, tp_src: int = 0, **engine_kwargs):
        sglang = import_sglang()
        self.tp_group, self.tp_src = tp_group, tp_src
        self.tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.is_src = tp_group is None or dist.get_rank() == tp_src
        self.engine = (sglang.Engine(model_path=model_path, tp_size=self.tp_size, **engine_kwargs)
                       if self.is_src else None)
        self.updates = GatheredUpdates(tp_group, tp_src, self.tp_size)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Buffer locally; no collective (see the module docstring)."""
        self.updates.add(named_tensors)

    def finish_update(self) -> None:
        """The sync's one collective: gather every rank's buffer and load it (see module doc)."""
        from sglang.srt.utils import MultiprocessingSerializer

        gathered = self.updates.gather(
            lambda named: MultiprocessingSerializer.serialize(named, output_str=True))
        if self.is_src:
            from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

            req = UpdateWeightsFromTensorReqInput(serialized_named_tensors=gathered,
                                                  load_format=DIRECT_LOADER, flush_cache=True)
            self.engine.loop.run_until_complete(
                self.engine.tokenizer_manager.update_weights_from_tensor(req, None))

    def generate(self, prompt_ids, params: SamplingParams) -> GenerationOutput:
        prompts = as_prompt_lists(prompt_ids)
        box = [None]
        if self.is_src:
            sampling = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                        "top_p": params.top_p, "top_k": params.top_k, "sampling_seed": params.seed}
            outs = self.engine.generate(input_ids=prompts, sampling_params=sampling,
                                        return_logprob=True)
            box[0] = _to_output(outs, params)
        if self.tp_size > 1:
            dist.broadcast_object_list(box, src=self.tp_src, group=self.tp_group)
        return box[0]


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
