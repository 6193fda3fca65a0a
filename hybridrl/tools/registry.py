"""The tools of a run: built from ``rollout.multi_turn.tools``, looked up by name, called safely.

Contract: ``build_tools(specs, timeout_s)`` builds a ``ToolRegistry`` from a list of specs:
``calculator`` and ``python`` (the built-ins, ``hybridrl.tools.calculator`` /
``hybridrl.tools.python``) or ``"package.module:attr"`` naming a tool object, a tool class or
a no-argument factory (checked with ``hybridrl.tools.base.check_tool``). Unknown names, import
failures, two tools of one name and a python tool where the OS sandbox cannot start are one
``ValueError`` line. ``timeout_s`` (> 0) overrides each built-in's timeout.
``ToolRegistry.call(name, arguments)`` -> ``ToolResult``: an unknown tool is an error result
naming the known ones; everything else is ``run_tool``'s. ``schemas()`` lists the tools in the
chat templates' ``tools=`` form.
"""

from __future__ import annotations

import importlib

from hybridrl.tools.base import Tool, ToolResult, check_tool, run_tool, tool_schema


class ToolRegistry:
    """Tools by name (see the module docstring)."""

    def __init__(self, tools: list[Tool], max_output_chars: int = 2000) -> None:
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            check_tool(tool)
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}; names must be unique")
            self.tools[tool.name] = tool
        self.max_output_chars = int(max_output_chars)

    def __contains__(self, name: str) -> bool:
        return name in self.tools

    def names(self) -> list[str]:
        return sorted(self.tools)

    def schemas(self) -> list[dict]:
        return [tool_schema(self.tools[n]) for n in self.names()]

    def call(self, name: str, arguments) -> ToolResult:
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(f"error: no tool named {str(name)[:40]!r}; tools: "
                              f"{', '.join(self.names())}", error=True)
        return run_tool(tool, arguments, self.max_output_chars)


def _load(spec: str, timeout_s: float | None):
    if spec == "calculator":
        from hybridrl.tools.calculator import Calculator

        return Calculator(**({"timeout_s": timeout_s} if timeout_s else {}))
    if spec == "python":
        from hybridrl.tools.python import PythonTool

        tool = PythonTool(**({"timeout_s": timeout_s} if timeout_s else {}))
        try:
            tool.check()
        except RuntimeError as err:
            raise ValueError(f"rollout.multi_turn.tools: python: {err}") from None
        return tool
    if ":" not in spec:
        raise ValueError(f"rollout.multi_turn.tools: unknown tool {spec!r}; allowed: calculator, "
                         "python, or 'package.module:attr'")
    module, attr = spec.split(":", 1)
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"rollout.multi_turn.tools: cannot load {spec!r} ({err})") from None
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "call")):
        obj = obj()  # a class or a factory
    return obj


def build_tools(specs, timeout_s: float | None = None, max_output_chars: int = 2000) -> ToolRegistry:
    """The registry of ``specs`` (see the module docstring)."""
    return ToolRegistry([_load(str(s), timeout_s) for s in specs], max_output_chars)
