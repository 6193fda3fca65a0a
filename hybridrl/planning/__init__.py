"""Capacity planning: what a job needs before it runs (``hybridrl plan``).

Contract:
- ``memory``: per-GPU memory by phase and a verdict (``hybridrl plan --memory``, docs/memory.md).
- ``cli``: the ``hybridrl plan`` subcommand (the reshard dry run per strategy, or the memory plan).
- ``timing`` (with ``flops`` and ``hardware``): the predicted seconds of each phase of a step
  (``hybridrl plan --time``); ``search``: the best layouts by it (``--search``); ``calibrate``:
  the CPU's measured constants (``--calibrate``); ``timecli``: their flags and text
  (docs/scaling.md sections 4b-4d).

Layering: above ``hybridrl.reshard`` and ``hybridrl.models`` (it reads the parameter specs,
placements and the planner's cost summary; the CPU calibration times the model); nothing in
reshard/ or models/ imports this folder (``tests/unit/test_layering.py``).
"""
