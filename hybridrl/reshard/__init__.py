"""Zero-redundancy reshard of llama-family weights from the training to the generation layout.

Contract: pure specs (``specs``), placements (``placement``) and planning (``planner``;
``schedule``, the phases in which each rank consumes its local copies; ``summary``) need no
process group and no torch, and are re-exported here; the torch side,
``executor.run_plan`` moving the planned rows into an ``assemble.Assembler`` that delivers one of
the ``formats`` (gen megatron shards, the SGLang-style engine format, full HF tensors), is imported
from its module. Every strategy executes as point-to-point isend/irecv (the micro-DP "all-gather"
and the allgather baseline included). See docs/reshard.md.
"""

from hybridrl.reshard.placement import (
    Placement,
    default_gen_placement,
    gen_placement,
    train_placement,
)
from hybridrl.reshard.planner import STRATEGIES, Plan, plan_reshard
from hybridrl.reshard.schedule import PhaseSchedule, local_phases, phase_schedule
from hybridrl.reshard.specs import PRESETS, LlamaShape, ParamSpec, build_specs
from hybridrl.reshard.summary import summarize, table2

__all__ = [
    "LlamaShape", "PRESETS", "ParamSpec", "PhaseSchedule", "Placement", "Plan", "STRATEGIES",
    "build_specs", "default_gen_placement", "gen_placement", "local_phases", "phase_schedule",
    "plan_reshard", "summarize", "table2", "train_placement",
]
