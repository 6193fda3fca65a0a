"""Multi-turn rollouts with tools: the agent loop (``loop``), turn formats and the loss mask
(``format``), the worker wrap that runs the loop where the engine is (``wrap``).
docs/rollout.md, section "Multi-turn rollouts with tools"."""

from hybridrl.rollout.multi_turn.format import ToolCall, TurnFormat, build_format, loss_mask
from hybridrl.rollout.multi_turn.loop import AgentLoop, Budgets, LoopOutput
from hybridrl.rollout.multi_turn.wrap import MultiTurnWorker, build_multi_turn

__all__ = ["AgentLoop", "Budgets", "LoopOutput", "MultiTurnWorker", "ToolCall", "TurnFormat",
           "build_format", "build_multi_turn", "loss_mask"]
