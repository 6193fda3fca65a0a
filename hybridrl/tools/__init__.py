"""Tools for multi-turn rollouts: the protocol (``base``), the registry, the built-ins
(``calculator``, ``python``). docs/rollout.md, section "Multi-turn rollouts with tools"."""

from hybridrl.tools.base import Tool, ToolResult, check_arguments, run_tool
from hybridrl.tools.registry import ToolRegistry, build_tools

__all__ = ["Tool", "ToolRegistry", "ToolResult", "build_tools", "check_arguments", "run_tool"]
