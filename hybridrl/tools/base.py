"""The tool protocol of multi-turn rollouts: a name, JSON-schema arguments, a call that returns
text, a timeout; and the one place that runs a call so that nothing a tool does ends a rollout.

Contract:
- A ``Tool`` has ``name`` (``[A-Za-z_][A-Za-z0-9_]*``), ``description``, ``parameters`` (a JSON
  schema of an object: ``properties`` with ``type`` string / integer / number / boolean /
  object / array, ``required``), ``timeout_s`` and ``call(arguments: dict) -> str``. A tool
  whose ``in_process`` is True (the calculator: bounded by construction) runs in the calling
  thread; every other tool runs in a forked child process that is killed at ``timeout_s``
  (a Python function can hang in C code where no thread could stop it).
- ``check_arguments(parameters, arguments)`` -> None or one line naming the first problem
  (not an object, a missing required key, an unknown key, a wrong type).
- ``run_tool(tool, arguments, max_output_chars)`` -> ``ToolResult(text, error, timed_out)``:
  never raises for anything the tool or the model did. Bad arguments, an exception, a
  timeout, a child that dies, a non-string result become ``error`` results whose text is one
  line (``error: ...``); output longer than ``max_output_chars`` is cut to that many characters
  followed by ``[... N more characters]``.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import re
import signal
from typing import Any, Protocol

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
          "object": (dict,), "array": (list,)}


class Tool(Protocol):
    name: str
    description: str
    parameters: dict
    timeout_s: float
    in_process: bool

    def call(self, arguments: dict) -> str: ...


@dataclasses.dataclass(frozen=True)
class ToolResult:
    text: str
    error: bool = False
    timed_out: bool = False


def tool_schema(tool: Tool) -> dict:
    """The tool as the chat templates' ``tools=`` entry (OpenAI function format)."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": tool.parameters}}


def check_tool(tool: Any) -> None:
    """ValueError (one line) unless ``tool`` has what the protocol needs."""
    name = getattr(tool, "name", None)
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError(f"tool {tool!r}: name must match {NAME.pattern}, got {name!r}")
    if not callable(getattr(tool, "call", None)):
        raise ValueError(f"tool {name}: needs a call(arguments) -> str method")
    params = getattr(tool, "parameters", None)
    if not isinstance(params, dict) or params.get("type") != "object":
        raise ValueError(f"tool {name}: parameters must be a JSON schema with type 'object'")
    timeout = getattr(tool, "timeout_s", None)
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"tool {name}: timeout_s must be a positive number, got {timeout!r}")


def check_arguments(parameters: dict, arguments: Any) -> str | None:
    """The first problem of ``arguments`` against the object schema ``parameters``, or None."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    props = parameters.get("properties", {})
    missing = [k for k in parameters.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument {missing[0]!r}"
    if parameters.get("additionalProperties", False) is False:
        extra = [k for k in arguments if k not in props]
        if extra:
            return f"unknown argument {str(extra[0])[:40]!r}; allowed: {sorted(props)}"
    for key, value in arguments.items():
        kind = props.get(key, {}).get("type")
        ok = _TYPES.get(kind)
        if ok is not None and (not isinstance(value, ok) or (kind != "boolean"
                                                             and isinstance(value, bool))):
            return f"argument {key!r} must be {kind}, got {type(value).__name__}"
    return None


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}[... {len(text) - limit} more characters]"


def _error(text: str, timed_out: bool = False) -> ToolResult:
    line = " ".join(str(text).split())[:300]
    return ToolResult(f"error: {line}", error=True, timed_out=timed_out)


def _child(tool, arguments, limit, conn) -> None:  # runs in the forked child
    try:
        out = tool.call(arguments)  # cut here: a huge result never crosses the pipe
        conn.send(("ok", _cut(out, limit) if isinstance(out, str) else None, type(out).__name__))
    except BaseException as err:  # noqa: BLE001 - everything becomes tool output
        conn.send(("err", f"{type(err).__name__}: {err}", ""))
    finally:
        conn.close()


def _in_child(tool: Tool, arguments: dict, max_output_chars: int) -> ToolResult:
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(tool, arguments, max_output_chars, send), daemon=True)
    proc.start()
    send.close()
    try:
        if not recv.poll(float(tool.timeout_s)):
            return _error(f"tool {tool.name} timed out after {tool.timeout_s:g} s", True)
        try:
            status, payload, kind = recv.recv()
        except (EOFError, OSError):
            proc.join(1.0)
            return _error(f"tool {tool.name} died (exit status {proc.exitcode})")
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        recv.close()
    if status == "err":
        return _error(payload)
    if payload is None:
        return _error(f"tool {tool.name} returned {kind}, not text")
    return ToolResult(payload)


def run_tool(tool: Tool, arguments: Any, max_output_chars: int = 2000) -> ToolResult:
    """One call of ``tool`` (see the module docstring); never raises for the tool's faults."""
    problem = check_arguments(tool.parameters, arguments)
    if problem is not None:
        return _error(f"{tool.name}: {problem}")
    if not getattr(tool, "in_process", False):
        return _in_child(tool, arguments, max_output_chars)
    try:
        out = tool.call(arguments)
    except Exception as err:  # noqa: BLE001 - everything becomes tool output
        return _error(f"{type(err).__name__}: {err}")
    if not isinstance(out, str):
        return _error(f"tool {tool.name} returned {type(out).__name__}, not text")
    return ToolResult(_cut(out, max_output_chars))
