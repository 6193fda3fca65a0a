"""The calculator tool: integer and decimal arithmetic on model-written text, parsed, never
evaluated as code.

Contract: ``Calculator().call({"expression": text})`` returns the value of ``text`` as a string
(digits when the value is whole, else ``repr`` of the float). Allowed: decimal numbers, ``+ - * / // % **``, unary ``+ -``, parentheses and nothing
else (no names, calls, attributes, strings). The model's text is hostile, so every cost is
bounded before it is paid: at most ``max_chars`` characters and ``max_nodes`` syntax nodes,
integer results of at most ``max_digits`` digits (a power is refused before it is computed
when its size would pass that), exponents of at most ``max_exponent``. Violations and
arithmetic faults (division by zero) raise ``ValueError`` with one line, which
``hybridrl.tools.base.run_tool`` turns into tool output. It runs in the calling process
(``in_process``): its time is bounded by the limits above.
"""

from __future__ import annotations

import ast
import math
import operator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class Calculator:
    """``calculator(expression)``: see the module docstring."""

    name = "calculator"
    description = "Evaluate an arithmetic expression (+ - * / // % ** and parentheses)."
    parameters = {"type": "object", "required": ["expression"],
                  "properties": {"expression": {"type": "string",
                                                "description": "e.g. 123456 + 654321"}}}
    in_process = True

    def __init__(self, timeout_s: float = 1.0, max_chars: int = 200, max_nodes: int = 64,
                 max_digits: int = 100, max_exponent: int = 1000) -> None:
        self.timeout_s, self.max_chars, self.max_nodes = timeout_s, max_chars, max_nodes
        self.max_digits, self.max_exponent = max_digits, max_exponent

    def call(self, arguments: dict) -> str:
        return format_number(self.evaluate(str(arguments["expression"])))

    def evaluate(self, text: str) -> int | float:
        """The value of ``text`` (ValueError with one line when it is not allowed)."""
        if len(text) > self.max_chars:
            raise ValueError(f"expression has {len(text)} characters; at most {self.max_chars}")
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except (SyntaxError, RecursionError, MemoryError):
            raise ValueError(f"not an arithmetic expression: {text[:60]!r}") from None
        nodes = sum(1 for _ in ast.walk(tree))
        if nodes > self.max_nodes:
            raise ValueError(f"expression has {nodes} parts; at most {self.max_nodes}")
        return self._value(tree.body)

    def _value(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return self._checked(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._value(node.left), self._value(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            try:
                return self._checked(_BINARY[type(node.op)](left, right))
            except (ZeroDivisionError, OverflowError) as err:
                raise ValueError(str(err)) from None
        raise ValueError(f"not allowed in an expression: {type(node).__name__}")

    def _check_power(self, base, exp) -> None:
        if abs(exp) > self.max_exponent:
            raise ValueError(f"exponent {exp} is larger than {self.max_exponent}")
        if isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1:
            digits = exp * math.log10(abs(base))
            if digits > self.max_digits:
                raise ValueError(f"result would have ~{digits:.0f} digits; at most "
                                 f"{self.max_digits}")

    def _checked(self, value):
        if isinstance(value, complex):
            raise ValueError("complex result")
        if isinstance(value, int) and value.bit_length() > 3.33 * self.max_digits:
            raise ValueError(f"result has more than {self.max_digits} digits")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("result is not finite")
        return value


def format_number(value: int | float) -> str:
    """Integers as digits, whole floats too (``6.0`` -> ``6``), other floats as ``repr``."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)
