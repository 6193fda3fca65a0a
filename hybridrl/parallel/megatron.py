"""Hand hybridrl's training groups to megatron-core, so megatron uses exactly these groups.

Contract:
- ``to_process_group_collection(groups)`` returns a megatron-core ``ProcessGroupCollection`` whose
  members are hybridrl's groups (pass it as ``pg_collection=`` to GPTModel, DDP, optimizers).
- ``apply_megatron_groups(groups)`` additionally installs the same groups into
  ``megatron.core.parallel_state`` for the megatron code paths that still read its module state
  (``get_tensor_model_parallel_rank()`` and friends). megatron keeps one layout per process in module
  globals; this is the only place hybridrl writes them, and ``clear_megatron_groups()`` undoes it.
  No group is created here: megatron never builds groups of its own, in its own order.
"""

from __future__ import annotations

from hybridrl.parallel.groups import ParallelGroups

_PGC_FIELDS = (
    "tp",
    "pp",
    "mp",
    "embd",
    "pos_embd",
    "cp",
    "tp_cp",
    "ep",
    "expt_tp",
    "tp_ep",
    "tp_ep_pp",
    "tp_dp_cp",
    "dp",
    "dp_cp",
    "expt_dp",
)


def to_process_group_collection(groups: ParallelGroups):
    """megatron-core ProcessGroupCollection built from hybridrl's groups (no new groups)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection(**{name: groups.groups.get(name) for name in _PGC_FIELDS})
    pgc.hcp = None
    pgc.intra_dp_cp = groups.dp_cp
    pgc.intra_expt_dp = groups.expt_dp
    pgc.inter_dist_opt = None
    pgc.intra_dist_opt = groups.groups["intra_dist_opt"]
    return pgc


def _state_values(groups: ParallelGroups) -> dict[str, object]:
    """parallel_state global name -> value (cp=1; the expert groups from the expert layout)."""
    g = groups.groups
    m = {k: list(v) for k, v in groups.members.items()}
    # megatron leaves the embedding groups None on ranks outside them; so do we
    g = {**g, "embd": g.get("embd"), "pos_embd": g.get("pos_embd")}
    m = {**m, "embd": m.get("embd"), "pos_embd": m.get("pos_embd")}
    return {
        "_TENSOR_MODEL_PARALLEL_GROUP": g["tp"],
        "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": m["tp"],
        "_PIPELINE_MODEL_PARALLEL_GROUP": g["pp"],
        "_PIPELINE_GLOBAL_RANKS": m["pp"],
        "_MODEL_PARALLEL_GROUP": g["mp"],
        "_MODEL_PARALLEL_GLOBAL_RANKS": m["mp"],
        "_EMBEDDING_GROUP": g["embd"],
        "_EMBEDDING_GLOBAL_RANKS": m["embd"],
        "_POSITION_EMBEDDING_GROUP": g["pos_embd"],
        "_POSITION_EMBEDDING_GLOBAL_RANKS": m["pos_embd"],
        "_DATA_PARALLEL_GROUP": g["dp"],
        "_DATA_PARALLEL_GROUP_GLOO": groups.gloo_dp,
        "_DATA_PARALLEL_GLOBAL_RANKS": m["dp"],
        "_DATA_PARALLEL_GROUP_WITH_CP": g["dp_cp"],
        "_DATA_PARALLEL_GROUP_WITH_CP_AG": g["dp_cp"],
        "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": groups.gloo_dp_cp,
        "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": m["dp_cp"],
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": g["dp_cp"],
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": groups.gloo_dp_cp,
        "_CONTEXT_PARALLEL_GROUP": g["cp"],
        "_CONTEXT_PARALLEL_GLOBAL_RANKS": m["cp"],
        "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": g["tp_cp"],
        "_TENSOR_AND_DATA_PARALLEL_GROUP": g["tp_dp"],
        "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": g["tp_dp_cp"],
        "_EXPERT_MODEL_PARALLEL_GROUP": g["ep"],
        "_EXPERT_MODEL_PARALLEL_RANKS": m["ep"],
        "_EXPERT_TENSOR_PARALLEL_GROUP": g["expt_tp"],
        "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": g["tp_ep"],
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": g["tp_ep_pp"],
        "_EXPERT_DATA_PARALLEL_GROUP": g["expt_dp"],
        "_EXPERT_DATA_PARALLEL_GROUP_GLOO": groups.gloo_expt_dp,
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": g["expt_dp"],
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": groups.gloo_expt_dp,
        "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": g["intra_dist_opt"],
    }


def apply_megatron_groups(groups: ParallelGroups):
    """Install ``groups`` as megatron-core's model-parallel state; returns the collection."""
    from megatron.core import parallel_state as ps

    clear_megatron_groups()
    for name, value in _state_values(groups).items():
        if not hasattr(ps, name):
            raise RuntimeError(f"megatron.core.parallel_state has no {name}: unsupported version")
        setattr(ps, name, value)
    return to_process_group_collection(groups)


def clear_megatron_groups() -> None:
    """Forget the installed groups (megatron's destroy_model_parallel); the groups stay alive.

    megatron's ``destroy_model_parallel`` destroys the process groups held in its ``*_GLOO``
    globals; those are hybridrl's groups (on gloo, the DP groups themselves), owned by
    ``ParallelGroups``, so they are detached first and only the references are dropped.
    """
    from megatron.core import parallel_state as ps

    for name in dir(ps):
        if name.startswith("_") and name.endswith("_GLOO") and name.isupper():
            setattr(ps, name, None)
    ps.destroy_model_parallel()
