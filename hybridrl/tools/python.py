"""The Python interpreter tool: the model's code runs in the code reward's OS sandbox.

Contract: ``PythonTool().call({"code": text})`` runs ``text`` as ``main.py`` under
``hybridrl.rewards.sandbox.Sandbox`` (no network, a private root, rlimits on memory, CPU,
file size, files and processes; killed at ``timeout_s`` of wall time, nothing left running)
and returns what it printed: standard output, then the last line of standard error when the
program failed (``exit status N`` when it wrote none), or ``error: timed out after T s``.
``in_process``: the sandbox enforces the timeout itself, no extra process is forked.
``check()`` raises the sandbox's one line (``SandboxUnavailable``) where the OS cannot build
it; ``hybridrl.tools.registry.build_tools`` calls it at start-up, so a run that lists the tool
on such a machine stops before training.
"""

from __future__ import annotations

from hybridrl.rewards.sandbox import Sandbox


class PythonTool:
    """``python(code)``: see the module docstring."""

    name = "python"
    description = "Run a Python program in a sandbox and return what it prints."
    parameters = {"type": "object", "required": ["code"],
                  "properties": {"code": {"type": "string", "description": "a Python program"}}}
    in_process = True  # the sandbox kills the program at timeout_s

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 256, max_output_bytes: int = 1 << 16,
                 sandbox: Sandbox | None = None) -> None:
        self.timeout_s, self.memory_mb, self.max_output_bytes = timeout_s, memory_mb, max_output_bytes
        self.sandbox = sandbox or Sandbox()

    def check(self) -> None:
        self.sandbox.check()

    def call(self, arguments: dict) -> str:
        limits = {"memory_mb": self.memory_mb, "cpu_s": max(1, int(self.timeout_s) + 1),
                  "max_file_bytes": self.max_output_bytes, "max_open_files": 64,
                  "max_processes": 8}
        res = self.sandbox.run(["python", "main.py"], {"main.py": str(arguments["code"]).encode()},
                               b"", limits, self.timeout_s)
        out = res.stdout.decode("utf-8", "replace")
        if res.timed_out:
            return f"{out}error: timed out after {self.timeout_s:g} s"
        if res.returncode != 0:
            lines = [ln for ln in res.stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
            return f"{out}{lines[-1] if lines else f'exit status {res.returncode}'}"
        return out
