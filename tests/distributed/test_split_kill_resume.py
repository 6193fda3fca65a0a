"""kill -9 with batches in flight (issues 29, 39): a 2-rank torchrun job, split placement (rank 0
trains, rank 1 generates) with rollouts up to two steps ahead (``rollout.async_steps=2``; k = 1
resumes in process in test_split_placement), killed with SIGKILL once step 2 is logged and
resumed with ``trainer.resume=auto``, logs exactly the metrics of the uninterrupted run (its
checkpoint holds the two batches generated for the next steps; the resume uses them;
``rollout/gen_syncs``, counted per process, and ``rollout/handoff_bytes``, aside). Also runs the entrypoint's split path end to end (hybridrl.train: groups,
generation loop, stop, the final barrier over both sets)."""

from __future__ import annotations

import os

import pytest

from tests.distributed.test_kill_resume import (
    STEPS,
    _finish,
    _killed_and_resumed,
    _launch,
    _metrics,
    in_parallel,
)

SPLIT = ("parallel.placement=split", "parallel.gen.world=1", "rollout.async_steps=2")


@pytest.mark.slow
def test_split_async_sigkill_resumes_to_the_uninterrupted_metrics(tmp_path):
    root = str(tmp_path)
    full, killed = os.path.join(root, "full", "run"), os.path.join(root, "killed", "run")
    _, seen = in_parallel(lambda: _finish(_launch(root, full, *SPLIT)),
                          lambda: _killed_and_resumed(root, killed, *SPLIT))
    assert "step 2/" in seen
    want, got = _metrics(full), _metrics(killed)
    assert sorted(want) == list(range(1, STEPS + 1))
    assert [want[s]["rollout/staleness"] for s in sorted(want)] == [0.0, 1.0] + [2.0] * (STEPS - 2)
    # rollout/gen_syncs counts the syncs of the generation rank's process (a resumed one
    # counts from 0): not a training quantity; every other metric has the same bits
    # and rollout/handoff_bytes: the resumed step takes its batch from the checkpoint, not the wire
    for m in (*want.values(), *got.values()):
        m.pop("rollout/gen_syncs")
        m.pop("rollout/handoff_bytes")
    assert got == want  # steps 3 and 4 from global_step_2 and the batch it holds: same bits
