"""Rank-side bodies of the failure tests (module level so forkserver ranks can import them).

Each case builds a trainer from ``test_trainer_cases.base_overrides`` plus its own overrides and
returns plain values: what was raised (type and message), the guard's metrics, whether the
parameters stayed finite and whether a checkpoint holds non-finite values.
"""

from __future__ import annotations

import glob
import io
import math
import sys
import time

import torch
import torch.distributed as dist

from tests.distributed.test_trainer_cases import _params, _same, _trainer, base_overrides


def _finite_checkpoints(folder: str) -> list[bool]:
    from hybridrl.checkpoint.folder import nonfinite_paths

    out = []
    for path in sorted(glob.glob(f"{folder}/global_step_*/*.pt")):
        out.append(not nonfinite_paths(torch.load(path, weights_only=False)))
    return out


def _nan_loss(rank, world, overrides, nan_at=2):
    """Step ``nan_at``'s actor loss is NaN on the last rank only (the others stay finite)."""
    trainer, lines = _trainer(rank, world, overrides)
    loss_method = trainer._actor_loss

    def poisoned(outputs, batch, *, norm, k):
        loss, metrics = loss_method(outputs, batch, norm=norm, k=k)
        if trainer.step + 1 == nan_at and rank == world - 1:
            loss = loss * math.nan
        return loss, metrics

    trainer._actor_loss = poisoned
    snapshots, take = [0], trainer._snapshot

    def counted_snapshot():
        snapshots[0] += 1
        return take()

    trainer._snapshot = counted_snapshot
    history, error, before, restored = [], None, None, None
    try:
        while trainer.step < trainer.total_steps:
            if trainer.step + 1 == nan_at:
                before = _params(trainer)
            m = trainer.train_step()
            trainer.step += 1
            trainer.log.step(trainer.step, trainer.total_steps, m)
            history.append({k: v for k, v in m.items() if k.startswith("training/")})
            if trainer.step == nan_at:
                restored = _same(before, _params(trainer))
            trainer.save()
    except RuntimeError as err:
        error = str(err)
    return {"history": history, "error": error, "lines": lines,
            "restored": restored, "snapshots": snapshots[0],
            "finite": all(bool(torch.isfinite(p).all()) for p in _params(trainer).values()),
            "ckpt_finite": _finite_checkpoints(trainer.ckpt.root)}


def _fit_or_error(rank, world, overrides):
    trainer, lines = _trainer(rank, world, overrides)
    try:
        history = trainer.fit()
    except Exception as err:  # noqa: BLE001 - the test looks at what was raised
        return {"error": f"{type(err).__name__}: {err}", "lines": lines}
    return {"error": None, "lines": lines,
            "history": [{k: v for k, v in m.items() if k.startswith("training/")}
                        for m in history]}


def _padding_resume(rank, world, overrides):
    """Issue 32 item 10: 2 steps straight vs 1 step, save, resume, 1 more: the actor's weights,
    vocab-padding rows included, are bitwise the same (they were random vs zero)."""
    straight, _ = _trainer(rank, world, [*overrides, "trainer.experiment_name=pad_a"])
    straight.fit()
    first, _ = _trainer(rank, world, [*overrides, "trainer.experiment_name=pad_b",
                                      "trainer.total_steps=1", "trainer.save_freq=1"])
    first.fit()
    resumed, _ = _trainer(rank, world, [*overrides, "trainer.experiment_name=pad_b"])
    resumed.fit()
    a, b = _params(straight), _params(resumed)
    emb = "embedding.word_embeddings.weight"
    vocab = straight.actor.spec.vocab_size
    return {"same": _same(a, b), "steps": (straight.step, resumed.step),
            "pad_zero": bool((a[emb][vocab:] == 0).all()) if emb in a else None}


ACTIONS = {"nan_loss": _nan_loss, "fit": _fit_or_error, "padding_resume": _padding_resume}


def run_cases(rank: int, world: int, root: str, cases: list) -> dict:
    return {name: ACTIONS[action](rank, world, base_overrides(root) + overrides)
            for name, overrides, action in cases}


def phase_timeout(rank: int, world: int) -> dict:
    """Rank 1 lingers in timing_s/reward; rank 0 waits in a collective of timing_s/update_actor
    on a group with a 2 s timeout: its error is a timeout naming rank 1 and its phase. Then the
    failure reporter: both ranks report one shared message (shown once) and rank 1 its own."""
    import datetime

    from hybridrl.exits import FailureReporter
    from hybridrl.parallel.phases import PhaseBoard, is_timeout

    board = PhaseBoard.from_default_group()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    timing = board.step_timing(3)
    timing.enter("timing_s/update_actor" if rank == 0 else "timing_s/reward")
    out = {}
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(1), group=group)
        except RuntimeError as err:
            out["timeout"] = is_timeout(err)
            out["line"] = board.describe_timeout(rank, 2.0)
    else:  # lingers in timing_s/reward: it never joins that all_reduce, so rank 0's timeout
        time.sleep(6)  # does not depend on this sleep's length or on load
    dist.barrier()
    captured, sys.stderr = sys.stderr, io.StringIO()
    try:
        reporter = FailureReporter(rank, board.store)
        if rank == 0:
            reporter.report(1, "the same problem everywhere")
        dist.barrier()  # rank 0 reported the shared error first (was: a 0.5 s sleep on rank 1)
        if rank == 1:
            reporter.report(1, "the same problem everywhere")
        dist.barrier()
        if rank == 1:
            reporter.report(1, "only rank 1 hit this")
        out["stderr"] = sys.stderr.getvalue()
    finally:
        sys.stderr = captured
    return out


def startup_refusal(rank: int, world: int, argv: list) -> dict:
    """``hybridrl.train.main(argv)`` on this rank with every collective and the process-group
    set-up replaced by a tripwire: what it returned and wrote to stderr, and whether it reached
    a collective (it must not: start-up problems are found before any)."""
    import hybridrl.parallel.groups as groups_mod
    from hybridrl.train import main

    reached = []

    def tripwire(name):
        def called(*args, **kwargs):
            reached.append(name)
            raise RuntimeError(f"{name} reached")
        return called

    names = ("barrier", "all_reduce", "broadcast", "all_gather", "broadcast_object_list",
             "all_gather_object", "init_process_group", "new_group")
    saved = {n: getattr(dist, n) for n in names}
    saved_init = groups_mod.init_distributed
    captured, sys.stderr = sys.stderr, io.StringIO()
    try:
        for n in names:
            setattr(dist, n, tripwire(n))
        groups_mod.init_distributed = tripwire("init_distributed")
        try:
            status = main(argv)
        except RuntimeError as err:
            status = f"raised {err}"
        err = sys.stderr.getvalue()
    finally:
        sys.stderr = captured
        for n, fn in saved.items():
            setattr(dist, n, fn)
        groups_mod.init_distributed = saved_init
    return {"status": status, "stderr": err, "reached": reached}
