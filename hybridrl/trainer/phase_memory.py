"""Colocated memory lifecycle of the trainer's models: what lives on the device in each phase.

Contract:
- ``PhaseMemory(roles)`` takes ``{role: (ShardedModel, ModelOptimizer | None, offload)}`` where
  ``offload`` is the set of parts (``"params"``, ``"grads"``, ``"optim"``) the role may keep in
  host memory outside the phases that need them (verl-style ``param_offload``, ``grad_offload``,
  ``optimizer_offload`` flags; the reference and reward models have only ``"params"``).
- ``enter(phase)`` makes exactly the parts ``NEEDS[phase]`` names resident (those not
  offloadable always are) and moves every other offloadable part to host memory
  (``hybridrl.models.offload``): e.g. during ``"gen"`` nothing of the training side stays on the
  device, during ``"ref"`` only the reference's parameters. Parts already where they should be
  are not touched, so calling ``enter`` for the phase already entered costs nothing; with no
  offload flag set it never moves anything. Returns ``{"offload_s", "moved_bytes"}`` of the call.
- ``timed(timing, key)`` (a context manager) enters the memory phase of the step phase ``key``
  (``key`` itself when it is one of ``NEEDS``, ``TIMING_PHASE[key]``, else ``"gen"``), adds that
  move's seconds to ``timing["timing_s/offload"]`` and the seconds of its body to
  ``timing["timing_s/<key>"]``; a ``timing`` with ``enter`` (a ``PhaseBoard``'s step timing)
  records the phase first, for timeouts.
- ``resident_bytes()`` is the bytes of this rank's model/optimizer tensors on the device now
  (by role and part), measured from the storages.
- What moves: parameters and optimizer state are copied to host and back (bit-exact);
  gradients are dropped, not copied (``StorageOffloader.offload(keep=False)``): every update
  zeroes them before its first backward (``ModelOptimizer.zero_grad`` in ``train_step``) and
  nothing reads them outside it. ``moved_bytes`` counts every byte copied either way since the
  trainer started (per step: its difference).
- ``start_engine(build)`` (the colocated order, docs/memory.md "Phase order"): enters
  ``"engine_start"`` (every offloadable part leaves the device and the CUDA cache is emptied by
  the offloader), then calls ``build()`` (the ``RolloutWorker``), so an engine that sizes its
  KV pool from the free memory at start (SGLang) sees the training state away; returns what
  ``build`` returns and remembers it as the engine owner.
- ``trace``: a list (None: off) that ``enter`` appends ``(phase, resident parts, engine
  state)`` to: the parts with device bytes (``"actor/params"``...), and ``"absent"`` before
  ``start_engine``, ``"released"`` / ``"running"`` for an engine with a ``released`` flag
  (SGLang), ``"resident"`` for one that never gives its memory back (builtin).
"""

from __future__ import annotations

import contextlib
import time

from hybridrl.models.offload import PARTS, StorageOffloader, model_tensors, resident_bytes

ALL = {part: set(PARTS) for part in ("actor", "critic", "reference", "reward")}
NEEDS: dict[str, dict[str, set[str]]] = {
    "engine_start": {},  # the rollout engine profiles its memory: nothing of training on it
    "reshard": {"actor": {"params"}},
    "gen": {},
    "old_log_prob": {"actor": {"params"}},
    "ref": {"reference": {"params"}},
    "values": {"critic": {"params"}},
    "reward": {"reward": {"params"}},
    "update_critic": {"critic": set(PARTS)},
    "update_actor": {"actor": set(PARTS)},
    # a KL-guard snapshot or rollback: the optimizer state and the weights it rebuilds
    "snapshot": {"actor": {"params", "optim"}, "critic": {"params", "optim"}},
    "all": ALL,  # snapshots, rollbacks, checkpoints, validation
}
TIMING_PHASE = {"kl_guard": "old_log_prob"}  # a step phase -> its memory phase, if another
DROPPED = ("grads",)  # parts zeroed before their next use: freed, never copied


class PhaseMemory:
    """Which parts of which role sit on the device, phase by phase (see the module docstring)."""

    def __init__(self, roles: dict):
        self.roles = {name: r for name, r in roles.items() if r[0] is not None}
        for name, (_, _, offload) in self.roles.items():
            bad = set(offload) - set(PARTS)
            if bad:
                raise ValueError(f"{name}: unknown offload parts {sorted(bad)}; allowed {PARTS}")
        self._away: dict[tuple[str, str], StorageOffloader] = {}
        self.moved_bytes = 0
        self.trace: list | None = None
        self._engine_owner = None

    @property
    def enabled(self) -> bool:
        return any(offload for _, _, offload in self.roles.values())

    def _tensors(self, name: str, part: str):
        model, opt, _ = self.roles[name]
        return model_tensors(model, opt, part)

    def enter(self, phase: str) -> dict[str, float]:
        moved = self._move(phase)
        self._record(phase)
        return moved

    def _move(self, phase: str) -> dict[str, float]:
        if phase not in NEEDS:
            raise ValueError(f"unknown memory phase {phase!r}; known: {sorted(NEEDS)}")
        start, moved = time.perf_counter(), 0
        if not self.enabled:
            return {"offload_s": 0.0, "moved_bytes": 0.0}
        needs = NEEDS[phase]
        for name, (_, _, offload) in self.roles.items():  # free first: a lower peak
            for part in offload:
                key, wanted = (name, part), part in needs.get(name, ())
                if not wanted and key not in self._away:
                    mover = StorageOffloader()
                    moved += mover.offload(self._tensors(name, part), keep=part not in DROPPED)
                    self._away[key] = mover
        for name, (_, _, offload) in self.roles.items():
            for part in offload:
                key, wanted = (name, part), part in needs.get(name, ())
                if wanted and key in self._away:
                    moved += self._away.pop(key).onload()
        self.moved_bytes += moved
        return {"offload_s": time.perf_counter() - start, "moved_bytes": float(moved)}

    def start_engine(self, build):
        """Build the rollout engine (``build()``) with the training state off the device."""
        self.enter("engine_start")
        self._engine_owner = build()
        return self._engine_owner

    def engine_state(self) -> str:
        """``absent`` | ``released`` | ``running`` | ``resident`` (see the module docstring)."""
        engine = getattr(self._engine_owner, "engine", None)
        if engine is None:
            return "absent"
        released = getattr(engine, "released", None)
        return "resident" if released is None else ("released" if released else "running")

    def _record(self, phase: str) -> None:
        if self.trace is not None:
            on = tuple(k for k, v in sorted(self.resident_bytes().items()) if v)
            self.trace.append((phase, on, self.engine_state()))

    @contextlib.contextmanager
    def timed(self, timing: dict, key: str):
        """Time the step phase ``key`` with exactly its models' parts on the device."""
        moved = self._move(TIMING_PHASE.get(key, key if key in NEEDS else "gen"))
        self._record(key)
        timing["timing_s/offload"] = timing.get("timing_s/offload", 0.0) + moved["offload_s"]
        start = time.perf_counter()
        if hasattr(timing, "enter"):  # a PhaseBoard's step timing: the phase, for timeouts
            timing.enter(f"timing_s/{key}")
        yield
        timing[f"timing_s/{key}"] = (timing.get(f"timing_s/{key}", 0.0)
                                     + time.perf_counter() - start)

    def resident_bytes(self) -> dict[str, int]:
        """``{"<role>/<part>": bytes on the device now}`` for every role and part."""
        return {f"{name}/{part}": resident_bytes(self._tensors(name, part))
                for name in self.roles for part in PARTS if self._tensors(name, part)}
