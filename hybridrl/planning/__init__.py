"""Capacity planning: what a job needs before it runs (``hybridrl plan``).

Contract:
- ``memory``: per-GPU memory by phase and a verdict (``hybridrl plan --memory``, docs/memory.md).
- ``cli``: the ``hybridrl plan`` subcommand (the reshard dry run per strategy, or the memory plan).

Layering: above ``hybridrl.reshard`` (it reads the parameter specs, placements and the planner's
cost summary); nothing in reshard/ imports this folder (``tests/unit/test_layering.py``).
"""
