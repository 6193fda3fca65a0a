"""PPO forward over micro-batches through megatron-core's pipeline schedule.

Contract:
- A micro-batch is a dict with ``input_ids`` [B, T] (right-padded: every sequence starts at
  position 0; megatron's RoPE uses positions 0..T-1) and optionally ``labels`` [B, T] (default: the
  next token, ``input_ids`` shifted left, last column 0). Any other keys ride along to the loss.
  A packed micro-batch (``hybridrl.models.packing``) is ``input_ids`` [1, S] plus ``cu_seqlens``:
  the model gets megatron's ``PackedSeqParams`` (THD) and per-sequence position ids, so each
  sequence attends over itself alone with RoPE positions from 0; the default label of a
  sequence's last token is the next sequence's first token (never read: PPO reads response
  tokens only, through ``resp_index``). Outputs are [1, S].
- ``model_outputs(model, output, batch)`` turns the last stage's raw output into per-token
  tensors: actor/reference ``{"logprobs": [B, T], "entropy": [B, T]}`` (vocab-parallel, see
  ``vocab_parallel``), critic ``{"values": [B, T]}``. Position t scores ``labels[:, t]``.
- ``run_microbatches(model, microbatches, loss_fn=None, forward_only=True)`` runs megatron's
  forward(-backward) schedule for ``groups.pp_size`` stages. On the last pipeline stage it returns
  one dict per micro-batch: with ``loss_fn`` None the detached outputs; otherwise
  ``loss_fn(outputs, batch) -> (loss scalar, metrics dict)`` is called there and its loss is
  back-propagated (megatron divides it by the number of micro-batches). Other stages return [].
- With ``sequence_parallel`` at tp > 1, ``run_microbatches`` right-pads each micro-batch's
  per-position tensors (``SEQUENCE_KEYS``: ``input_ids`` with 0, ``labels``, ``loss_mask``) to a
  multiple of tp (``pad_to_multiple``, pure): megatron's sequence-parallel embedding scatters the
  sequence over the TP ranks. Right padding changes no earlier position (causal attention), and
  padded positions carry loss mask 0; PPO reads responses through ``resp_index``. A pack is
  padded at its tail only, the pad joining its last sequence (``packing.extend_tail``).
- Shared prompts: a pack with ``seg_parent`` [n] and ``position_ids`` [S]
  (``RolloutBatch.microbatch(share=True)``) gets those positions (RoPE) and the segments'
  parents on its ``PackedSeqParams`` (``pack_cached`` keys ``"positions"``, ``"parents"``),
  which the local spec's attention reads (``packing.shared_attention``); ``shares_prompts``
  tells whether a model's forward can take such a pack (the local spec's lean attention in
  every layer: not the TE spec, not megatron's own attention forward).
- Routing replay: a micro-batch with ``routed_experts`` [b, W, layers, k] (the rollout
  engine's top-k expert ids, ``RolloutBatch.routed_experts`` rows) runs its forward with every
  MoE router replaying them (``hybridrl.models.router_replay``); without the key a MoE model
  routes by itself.
- ``broadcast_from_last_stage(obj, groups)`` hands a picklable result to every stage.
- ``left_align`` / ``undo_left_align`` turn left-padded rows (verl's prompt layout) into rows that
  start at position 0 and map per-token outputs back.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from hybridrl.models.build import VALUE_ROLES, ShardedModel, ensure_megatron_state
from hybridrl.models.packing import extend_tail, pack_cached, packed_seq_params, positions
from hybridrl.models.router_replay import replaying
from hybridrl.models.vocab_parallel import vocab_parallel_logprobs_entropy

LossFn = Callable[[dict, dict], tuple[torch.Tensor, dict]]
SEQUENCE_KEYS = ("input_ids", "labels", "loss_mask")  # [B, T] tensors padded with the sequence


def pad_to_multiple(batch: dict, multiple: int) -> dict:
    """``batch`` with its ``SEQUENCE_KEYS`` right-padded (zeros) to T a multiple of ``multiple``."""
    t = batch["input_ids"].shape[1]
    extra = -t % multiple
    if not extra:
        return batch
    out = dict(batch)
    for key in SEQUENCE_KEYS:
        if key in batch:
            out[key] = torch.nn.functional.pad(batch[key], (0, extra))
    return out


def next_token_labels(input_ids_BT: torch.Tensor) -> torch.Tensor:
    """labels[:, t] = input_ids[:, t + 1]; the last column (nothing to predict) is 0."""
    labels_BT = torch.zeros_like(input_ids_BT)
    labels_BT[:, :-1] = input_ids_BT[:, 1:]
    return labels_BT


def left_align(tensor_BT: torch.Tensor, attention_mask_BT: torch.Tensor):
    """Rotate each row left by its number of leading pads (mask 0): right-padded rows that start
    at position 0, as megatron's RoPE needs. Returns (aligned [B, T], shift [B])."""
    if tensor_BT.shape != attention_mask_BT.shape:
        raise ValueError(f"tensor shape {tuple(tensor_BT.shape)} != attention_mask shape "
                         f"{tuple(attention_mask_BT.shape)}")
    shift_B = (attention_mask_BT.long().cumsum(dim=1) == 0).sum(dim=1)  # leading pads per row
    t = tensor_BT.shape[1]
    index_BT = (torch.arange(t, device=tensor_BT.device) + shift_B.unsqueeze(1)) % t
    return tensor_BT.gather(1, index_BT), shift_B


def undo_left_align(tensor_BT: torch.Tensor, shift_B: torch.Tensor) -> torch.Tensor:
    """Inverse of ``left_align``: per-token outputs back at the caller's original positions."""
    t = tensor_BT.shape[1]
    index_BT = (torch.arange(t, device=tensor_BT.device) - shift_B.unsqueeze(1)) % t
    return tensor_BT.gather(1, index_BT)


def model_outputs(
    model: ShardedModel, output: torch.Tensor, batch: dict, *, with_entropy: bool = True,
    temperature: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Per-token outputs from the last stage's GPTModel output ([B, T, V/tp] or [B, T, 1])."""
    if model.role in VALUE_ROLES:
        return {"values": output[..., 0].float()}  # [B, T]
    labels_BT = batch.get("labels")
    if labels_BT is None:
        labels_BT = next_token_labels(batch["input_ids"])
    logp_BT, entropy_BT = vocab_parallel_logprobs_entropy(
        output, labels_BT.to(output.device), model.groups.tp,
        vocab_start=model.vocab_start, vocab_size=model.spec.vocab_size,
        temperature=temperature, with_entropy=with_entropy,
    )
    out = {"logprobs": logp_BT}
    if entropy_BT is not None:
        out["entropy"] = entropy_BT
    return out


def _loss_func(model, batch, loss_fn, options, output):
    outputs = model_outputs(model, output, batch, **options)
    if loss_fn is None:
        zero = output.new_zeros(())
        return zero, {k: v.detach() for k, v in outputs.items()}
    loss, metrics = loss_fn(outputs, batch)
    # clone: megatron divides the returned loss in place by the number of micro-batches
    metrics = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in metrics.items()}
    return loss, {"loss": loss.detach().clone(), **metrics}


def shared_positions(position_ids_S: torch.Tensor, total: int) -> torch.Tensor:
    """A shared-prompt pack's host position ids, the sequence-parallel tail pad (which joins
    the last segment) continuing the last segment's positions up to ``total`` tokens."""
    pos = position_ids_S.long().cpu()
    extra = total - pos.numel()
    if extra <= 0:
        return pos
    return torch.cat([pos, pos[-1] + 1 + torch.arange(extra)])


def _forward_step(model, loss_fn, options, data_iterator, module):
    batch = next(data_iterator)
    input_ids_BT = batch["input_ids"].to(model.device)
    b, t = input_ids_BT.shape
    sp = model.groups.tp_size if getattr(model.config, "sequence_parallel", False) else 1
    replay = replaying(model.module, batch, t, model.groups.tp_rank if sp > 1 else 0, sp)
    if "cu_seqlens" in batch:  # a pack [1, S]: positions restart at every sequence (THD)
        cu = extend_tail(batch["cu_seqlens"], t).cpu()  # host copy: no device sync per pack
        params = packed_seq_params(cu, input_ids_BT.device)
        shared = "seg_parent" in batch  # shared prompts: each response continues its prompt
        host_pos = shared_positions(batch["position_ids"], t) if shared else positions(cu)
        if shared:
            pack_cached(params, "parents", lambda: [int(x) for x in batch["seg_parent"]])
            pack_cached(params, "positions", lambda: host_pos)
            # megatron's RoPE table holds max_seqlen positions: the furthest response's
            params.max_seqlen_q = params.max_seqlen_kv = max(params.max_seqlen_q,
                                                             int(host_pos.max()) + 1)
        pos = host_pos.to(input_ids_BT.device, non_blocking=True).unsqueeze(0)
        with replay:
            output = module(input_ids_BT, pos, None, packed_seq_params=params)
    else:
        position_ids_BT = torch.arange(t, device=input_ids_BT.device).expand(b, t)
        with replay:
            output = module(input_ids_BT, position_ids_BT, None)
    return output, functools.partial(_loss_func, model, batch, loss_fn, options)


def run_microbatches(
    model: ShardedModel,
    microbatches: Sequence[dict],
    loss_fn: LossFn | None = None,
    *,
    forward_only: bool = True,
    with_entropy: bool = True,
    temperature: float = 1.0,
) -> list[dict]:
    """Forward (and backward unless ``forward_only``) over ``microbatches``; last-stage results."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not microbatches:
        raise ValueError("microbatches must hold at least one micro-batch, got 0")
    if not forward_only and loss_fn is None:
        raise ValueError("a backward pass needs loss_fn")
    if getattr(model.config, "sequence_parallel", False) and model.groups.tp_size > 1:
        microbatches = [pad_to_multiple(mb, model.groups.tp_size) for mb in microbatches]
    shapes = [tuple(mb["input_ids"].shape) for mb in microbatches]
    if any(len(s) != 2 for s in shapes):
        raise ValueError(f"input_ids must be [B, T]; got shapes {shapes}")
    ensure_megatron_state(model.groups)
    options = {"with_entropy": with_entropy, "temperature": temperature}
    step = functools.partial(_forward_step, model, loss_fn, options)
    schedule = get_forward_backward_func(pp_size=model.groups.pp_size)
    grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()
    was_training = model.module.training
    if forward_only:
        model.module.eval()
    extra = {}
    if model.groups.pp_size > 1:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        extra["p2p_communicator"] = P2PCommunicator(pp_group=model.groups.pp, config=model.config)
    try:
        with grad_mode:
            results = schedule(
                forward_step_func=step, data_iterator=iter(microbatches),
                model=[model.schedule_module], num_microbatches=len(microbatches),
                seq_length=max(s[1] for s in shapes), micro_batch_size=max(s[0] for s in shapes),
                forward_only=forward_only, pg_collection=model.pg_collection, **extra,
            )
    finally:  # a failing schedule must not leave a training model in eval mode
        model.module.train(was_training)
    return list(results) if model.groups.is_last_stage else []


def shares_prompts(model: ShardedModel) -> bool:
    """True when every attention layer of ``model`` takes a shared-prompt pack (module doc)."""
    from hybridrl.models.local_spec import LeanSelfAttention

    layers = [m for m in model.module.modules() if isinstance(m, LeanSelfAttention)]
    return bool(layers) and all(m.lean_shared for m in layers)


def broadcast_from_last_stage(obj, groups):
    """Send a picklable object from the last pipeline stage to every stage of the pipeline."""
    if groups.pp_size == 1:
        return obj
    box = [obj if groups.is_last_stage else None]
    dist.broadcast_object_list(box, src=groups.members["pp"][-1], group=groups.pp)
    return box[0]
