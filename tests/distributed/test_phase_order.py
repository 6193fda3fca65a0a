"""The colocated phase order (docs/memory.md "Phase order"), recorded from a real PPO run.

One 1-rank gloo launch builds a ``PPOTrainer`` with every offload flag on, a KL guard, GAE with a
critic and a reference, and an engine that keeps SGLang's lifecycle (released right after it
starts, resumed by the weight sync, released after generating); ``PhaseMemory.trace`` records
(phase, training parts on the device, engine state) at every phase. Checked:
- the engine start and the second step equal the documented table row for row;
- mutations fail the same check: the engine built before the offload (the old order), the
  engine started with the actor resident;
- gradients are dropped, not copied: bytes copied per step vs the same run copying them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hybridrl.testing.dist import run_on_ranks
from tests.distributed.test_trainer_cases import base_overrides, run_in

DOC = Path(__file__).resolve().parents[2] / "docs" / "memory.md"
OFFLOAD = [f"{role}.{part}_offload=true" for role in ("actor", "critic")
           for part in ("param", "grad", "optimizer")] + ["ref.param_offload=true"]
CASES = ("ok", "built_first", "resident_at_start", "copy_grads")


def documented_order() -> list[tuple]:
    """The table between the phase-order markers of docs/memory.md."""
    text = DOC.read_text()
    body = text.split("<!-- phase-order-table -->")[1].split("<!-- /phase-order-table -->")[0]
    rows = []
    for line in body.strip().splitlines()[2:]:
        phase, parts, engine = (c.strip() for c in line.strip().strip("|").split("|"))
        on = () if parts == "—" else tuple(p.strip() for p in parts.split(","))
        rows.append((phase, on, engine))
    return rows


def check_order(trace: list[tuple], table: list[tuple]) -> None:
    """The engine start (first row) and the last step (from its snapshot) equal the table."""
    last = max(i for i, row in enumerate(trace) if row[0] == "snapshot")
    got = [tuple(trace[0])] + [tuple(r) for r in trace[last:]]
    got = [(p, tuple(on), e) for p, on, e in got]
    assert got == table, "\n".join(f"{g} != {w}" for g, w in zip(got, table) if g != w) or \
        f"{len(got)} rows vs {len(table)} documented"


def _rank(rank, world, root, case):
    """One trainer per case: its trace and the bytes copied at each step."""
    from hybridrl.rollout.worker import RolloutWorker
    from hybridrl.trainer import phase_memory
    from hybridrl.trainer.phase_memory import PhaseMemory
    from tests.distributed.test_trainer_cases import _trainer

    init, build = PhaseMemory.__init__, RolloutWorker._build_engine
    sync, release, start = RolloutWorker.sync_weights, RolloutWorker.release, \
        PhaseMemory.start_engine

    def traced_init(self, roles):
        init(self, roles)
        self.trace = []

    def sglang_like_build(self, *args):  # SGLang starts, then releases its memory
        engine = build(self, *args)
        engine.released = True
        return engine

    def resuming_sync(self, actor):
        self.engine.released = False
        return sync(self, actor)

    def releasing(self):
        release(self)
        self.engine.released = True

    def built_first(self, make):  # the old order: the engine exists before anything moves
        self._engine_owner = make()
        self.enter("engine_start")
        return self._engine_owner

    patches = [(PhaseMemory, "__init__", traced_init),
               (RolloutWorker, "_build_engine", sglang_like_build),
               (RolloutWorker, "sync_weights", resuming_sync),
               (RolloutWorker, "release", releasing)]
    needs, dropped = dict(phase_memory.NEEDS), phase_memory.DROPPED
    if case == "built_first":
        patches.append((PhaseMemory, "start_engine", built_first))
    if case == "resident_at_start":
        phase_memory.NEEDS["engine_start"] = {"actor": {"params"}}
    if case == "copy_grads":
        phase_memory.DROPPED = ()
    for cls, name, fn in patches:
        setattr(cls, name, fn)
    try:
        overrides = [*base_overrides(root), *OFFLOAD, *run_in(f"{root}/{case}"),
                     "algorithm.adv_estimator=gae", "actor.use_kl_loss=true",
                     "trainer.kl_guard.max_kl=100.0", "trainer.total_steps=2"]
        trainer, _ = _trainer(rank, world, overrides)
        step, copied = trainer.train_step, []

        def counted_step():
            before = trainer.memory.moved_bytes
            out = step()
            copied.append(trainer.memory.moved_bytes - before)
            return out

        trainer.train_step = counted_step
        trainer.fit()
        trace = [list(r) for r in trainer.memory.trace]
        trainer.memory.enter("all")
        grads = sum(v for k, v in trainer.memory.resident_bytes().items() if "grads" in k)
        return {"trace": trace, "copied": copied,
                "grad_bytes": grads}
    finally:
        for cls, name, fn in [(PhaseMemory, "__init__", init),
                              (RolloutWorker, "_build_engine", build),
                              (RolloutWorker, "sync_weights", sync),
                              (RolloutWorker, "release", release),
                              (PhaseMemory, "start_engine", start)]:
            setattr(cls, name, fn)
        phase_memory.NEEDS.clear()
        phase_memory.NEEDS.update(needs)
        phase_memory.DROPPED = dropped


def _all_cases(rank, world, root):
    return {case: _rank(rank, world, root, case) for case in CASES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("phase_order"))
    return run_on_ranks(_all_cases, 1, root, timeout=600)[0]


def test_documented_table_parses():
    table = documented_order()
    assert table[0] == ("engine_start", (), "absent")
    assert [r[0] for r in table][-3:] == ["update_critic", "update_actor", "kl_guard"]
    assert re.search(r"\| gen \| — \| running \|", DOC.read_text())


@pytest.mark.slow
def test_phase_order_matches_the_table(runs):
    check_order(runs["ok"]["trace"], documented_order())


@pytest.mark.slow
@pytest.mark.parametrize("case", ["built_first", "resident_at_start"])
def test_violated_order_fails_the_check(runs, case):
    with pytest.raises(AssertionError):
        check_order(runs[case]["trace"], documented_order())


@pytest.mark.slow
def test_gradients_are_dropped_not_copied(runs):
    """A whole step (the second: each grad buffer leaves and comes back once) copied exactly
    2 x (actor + critic grad bytes) more when the grads were copied."""
    ok, old = runs["ok"]["copied"], runs["copy_grads"]["copied"]
    grads = runs["ok"]["grad_bytes"]
    print(f"bytes copied per step: grads copied {old}, grads dropped {ok}, grads {grads}")
    assert grads > 0 and len(ok) == len(old) == 2
    assert old[1] - ok[1] == 2 * grads and ok[1] > 0
