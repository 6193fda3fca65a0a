"""Layout-free optimizer state: each rank's part as flat ranges of canonically named parameters.

Contract:
- ``collect_pieces(model, opt)`` (no communication) returns this rank's part of one trained
  model as ``(tensors, entries, extra)``. For every fp32 main parameter the rank's optimizer
  owns (with megatron's DistributedOptimizer: the DP rank's contiguous range ``[start, end)`` of
  the flattened local TP shard; with the plain optimizer every DP rank owns the whole shard, so
  parameter i is recorded only by DP rank ``i % dp``; a parameter replicated over TP only by
  TP rank 0; a MoE expert's TP and DP are expert TP and expert DP), ``tensors[f"{name}/{kind}"]`` is a host
  copy of that range for ``kind`` in ``param`` (the fp32 main parameter: it determines the
  model's weights) and each per-parameter optimizer tensor (Adam's ``exp_avg``,
  ``exp_avg_sq``). ``entries[name]`` = ``{tp_rank, tp_size, tp_dim, shape, start, end, kinds}``
  says where the range lies; ``name`` is the canonical parameter name
  (``hybridrl.models.naming``: global layer index), so no field depends on pp or dp.
  ``extra`` holds the layout-free rest: the optimizer's param-group hyperparameters (``step``
  included), Adam's scalar ``step``, ``step_count``, ``lr_scale`` and the fp16 grad scalers.
- ``load_pieces(model, opt, index, open_file)`` (no communication; call
  ``ModelOptimizer.rebuild_params()`` afterwards, collectively) fills this rank's main
  parameters and optimizer state from a checkpoint written at ANY (tp, pp, dp): ``index`` maps
  each canonical name to its saved ranges (``{"file": ..., **entry}`` each), ``open_file(file)``
  returns that file's tensor dict. Per parameter, the saved ranges of each old TP shard are
  put together, the old shards converted to HF tensors (``hybridrl.models.hf_io``:
  ``hf_tensors_from_full``, vocab padding dropped) and this rank's new shard sliced out of them
  (``local_slice_from_hf``: new vocab padding zero), then its range. Every step is a copy, so
  the values are bit-for-bit those saved. A missing or incomplete parameter raises
  ``ValueError`` naming it. Memory: one parameter's full tensor at a time.
"""

from __future__ import annotations

import torch

from hybridrl.models.hf_io import hf_tensors_from_full, local_slice_from_hf
from hybridrl.models.naming import expert_index, named_local_parameters, tp_partition_dim

PARAM = "param"


def _owned(opt) -> list[tuple[int, torch.Tensor, torch.Tensor, int, int]]:
    """(part index, main param, model param, start, end) for each main param of this rank."""
    out = []
    for i, part in enumerate(opt._parts):
        if hasattr(part, "model_float16_groups"):  # DistributedOptimizer: its DP range
            groups = zip(part.model_fp32_groups + part.model_float16_groups,
                         part.shard_fp32_groups + part.shard_fp32_from_float16_groups)
            for models, mains in groups:
                for model_p, main in zip(models, mains):
                    rng = part._get_model_param_range_map(model_p)["param"]
                    out.append((i, main, model_p, rng.start, rng.end))
        elif hasattr(part, "float16_groups"):  # Float16OptimizerWithFloat16Params
            for models, mains in zip(part.float16_groups + part.fp32_from_fp32_groups,
                                     part.fp32_from_float16_groups + part.fp32_from_fp32_groups):
                out += [(i, main, p, 0, p.numel()) for p, main in zip(models, mains)]
        else:  # FP32Optimizer: the model's parameters are the main parameters
            out += [(i, p, p, 0, p.numel()) for g in part.optimizer.param_groups
                    for p in g["params"]]
    return out


def _state_tensors(part, main) -> dict[str, torch.Tensor]:
    """Per-element optimizer tensors of ``main`` (Adam's moments), by key."""
    state = part.optimizer.state.get(main, {})
    return {k: v for k, v in state.items()
            if k != "step" and torch.is_tensor(v) and v.numel() == main.numel()}


def _shard_axes(groups, name: str) -> tuple[int, int, int, int]:
    """(tp rank, tp size, dp rank, dp size) that shard and replicate parameter ``name``: an
    expert's are expert TP and expert DP (megatron's expert generator), every other's the dense
    ones (with ep > 1 the dense DP ranks hold different experts: none of them may be skipped)."""
    if expert_index(name) is None or not hasattr(groups, "etp_rank"):
        return groups.tp_rank, groups.tp_size, groups.dp_rank, groups.dp_size
    return groups.etp_rank, groups.etp_size, groups.index("expt_dp"), groups.size("expt_dp")


def collect_pieces(model, opt) -> tuple[dict, dict, dict]:
    """This rank's part of one model's optimizer (see the module docstring)."""
    names = {id(p): n for n, p in named_local_parameters(model)}
    groups, distributed = model.groups, opt.distributed
    tensors, entries, adam_step = {}, {}, None
    for j, (i, main, model_p, start, end) in enumerate(_owned(opt)):
        name = names[id(model_p)]
        tp_rank, tp_size, dp_rank, dp_size = _shard_axes(groups, name)
        if end <= start or (not distributed and j % dp_size != dp_rank):
            continue
        dim = tp_partition_dim(model_p)
        if dim is None and tp_rank != 0:  # replicated over TP: TP rank 0's copy only
            continue
        part = opt._parts[i]
        kinds = {PARAM: main, **_state_tensors(part, main)}
        for kind, t in kinds.items():
            tensors[f"{name}/{kind}"] = t.detach().reshape(-1).to("cpu", copy=True)
        entries[name] = {"tp_rank": tp_rank if dim is not None else 0,
                         "tp_size": tp_size, "tp_dim": dim,
                         "shape": list(model_p.shape), "start": start, "end": end,
                         "kinds": sorted(kinds)}
        step = part.optimizer.state.get(main, {}).get("step")
        adam_step = adam_step if step is None else step
    extra = {"groups": [[{k: v for k, v in g.items() if k != "params"}
                         for g in part.optimizer.param_groups] for part in opt._parts],
             "adam_step": None if adam_step is None else torch.as_tensor(adam_step).clone(),
             "step_count": opt.step_count, "lr_scale": opt.lr_scale,
             "grad_scaler": [s.state_dict() if s is not None else None
                             for s in (getattr(p, "grad_scaler", None) for p in opt._parts)]}
    return tensors, entries, extra


class _PieceReader:
    """The HF reader interface of ``hf_io`` over one kind of saved state (lazy, per name)."""

    def __init__(self, index: dict, open_file, spec, role: str, kind: str):
        self.index, self.open_file, self.spec, self.role, self.kind = (
            index, open_file, spec, role, kind)
        self.hf_owner = {}  # HF name -> canonical name that produces it (shapes only: meta)
        for name, pieces in index.items():
            shards = self._shards(name, pieces, meta=True)
            for hf_name in hf_tensors_from_full(name, shards, spec, role):
                self.hf_owner[hf_name] = name
        self.cache: dict[str, torch.Tensor] = {}

    def _shards(self, name: str, pieces: list[dict], meta: bool = False) -> list[torch.Tensor]:
        """The old TP shards of ``name`` (one when it is replicated over TP)."""
        first = pieces[0]
        n_shards = first["tp_size"] if first["tp_dim"] is not None else 1
        out = []
        for tp_rank in range(n_shards):
            mine = [p for p in pieces if p["tp_rank"] == tp_rank]
            shape = mine[0]["shape"] if mine else first["shape"]
            if meta:
                out.append(torch.empty(shape, device="meta"))
                continue
            flat, covered = torch.empty(int(torch.Size(shape).numel())), 0
            for p in mine:
                if self.kind not in p["kinds"]:
                    raise ValueError(f"checkpoint: {name} has no saved {self.kind!r} state")
                flat[p["start"]:p["end"]] = self.open_file(p["file"])[f"{name}/{self.kind}"]
                covered += p["end"] - p["start"]
            if covered != flat.numel():
                raise ValueError(f"checkpoint: {name} (TP shard {tp_rank}) holds {covered} of "
                                 f"{flat.numel()} values: a rank's file is missing")
            out.append(flat.view(shape))
        return out

    def _tensor(self, hf_name: str) -> torch.Tensor:
        if hf_name not in self.cache:
            if hf_name not in self.hf_owner:
                raise ValueError(f"checkpoint holds no state for {hf_name!r}")
            name = self.hf_owner[hf_name]
            shards = self._shards(name, self.index[name])
            self.cache.update(hf_tensors_from_full(name, shards, self.spec, self.role))
        return self.cache[hf_name]

    def has(self, hf_name: str) -> bool:
        return hf_name in self.hf_owner

    def full(self, hf_name: str) -> torch.Tensor:
        return self._tensor(hf_name)

    def rows(self, hf_name: str, lo: int, hi: int) -> torch.Tensor:
        return self._tensor(hf_name)[lo:hi]

    def cols(self, hf_name: str, lo: int, hi: int) -> torch.Tensor:
        return self._tensor(hf_name)[:, lo:hi]


@torch.no_grad()
def load_pieces(model, opt, index: dict, open_file, extra: dict) -> None:
    """Fill this rank's main params and optimizer state from any layout (module docstring)."""
    names = {id(p): n for n, p in named_local_parameters(model)}
    kinds = sorted({k for pieces in index.values() for p in pieces for k in p["kinds"]})
    readers = {k: _PieceReader(index, open_file, model.spec, model.role, k) for k in kinds}
    adam_step = extra.get("adam_step")
    for i, main, model_p, start, end in _owned(opt):
        name, part = names[id(model_p)], opt._parts[i]
        if name not in index and not (name == "output_layer.weight"
                                      and model.spec.tie_word_embeddings):
            raise ValueError(f"checkpoint holds no state for parameter {name!r}")
        state = {}
        for kind, reader in readers.items():
            local = local_slice_from_hf(reader, name, model)
            if local is None:  # a critic head absent from the folder: keep it
                continue
            if tuple(local.shape) != tuple(model_p.shape):
                raise ValueError(f"checkpoint: {name} {kind} has shape {tuple(local.shape)}, "
                                 f"this rank's parameter {tuple(model_p.shape)}")
            value = local.reshape(-1)[start:end].to(main.device, main.dtype).view(main.shape)
            # (the DistributedOptimizer's main is a flat range; the plain optimizer's is the
            # parameter itself, and its Adam state has the parameter's shape)
            if kind == PARAM:
                main.copy_(value)
            else:
                state[kind] = value.clone()
            reader.cache.clear()
        if state:
            if adam_step is not None:
                state["step"] = adam_step.clone()
            part.optimizer.state[main] = state
    for part, saved in zip(opt._parts, extra["groups"]):
        if len(saved) == len(part.optimizer.param_groups):  # hyperparameters and group steps
            for group, values in zip(part.optimizer.param_groups, saved):
                group.update(values)
    for part, scaler in zip(opt._parts, extra["grad_scaler"]):
        if scaler is not None and getattr(part, "grad_scaler", None) is not None:
            part.grad_scaler.load_state_dict(scaler)
    opt.step_count, opt.lr_scale = int(extra["step_count"]), float(extra.get("lr_scale", 1.0))
