"""``hybridrl.trainer.overlap.Overlap`` at ``rollout.async_steps=k`` with a stand-in trainer and
worker (no ranks): up to k batches in flight, requested in step order with the step's seed, none
past the last step; staleness = the step minus the version that generated its batch; the
checkpoint form holds every batch in flight and a reload continues with the same batches and
staleness; the k = 1 form of earlier checkpoints loads (one step stale)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from hybridrl.config import load_config
from hybridrl.data.dataset import PromptBatch
from hybridrl.trainer.overlap import Overlap

SPLIT = ["parallel.placement=split", "parallel.gen.world=1"]


def _batch(i: int) -> PromptBatch:
    return PromptBatch(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long),
                       [[i, i]], [[]], [str(i)], ["s"], [{}], [""], [i])


class Worker:
    def __init__(self):
        self.requests, self.collected, self.kept = [], [], None
        self.last_gen_s = self.last_wait_s = 0.0
        self.last_syncs = 0

    def sampling_params(self, *a):
        return None

    def request(self, ids, params, seed):
        self.requests.append(seed)

    def collect(self, seed=None):
        self.collected.append(seed)

    def kept_state(self, seed):
        return {"seed": seed}

    def keep(self, states):
        self.kept = states


def _trainer(k: int, steps: int):
    cfg = load_config([], [*SPLIT, f"rollout.async_steps={k}"])
    made = iter(range(100))
    return types.SimpleNamespace(cfg=cfg, step=0, total_steps=steps, worker=Worker(),
                                 loader=types.SimpleNamespace(next_batch=lambda: _batch(next(made))),
                                 log=types.SimpleNamespace(line=lambda *a: None))


def _run(ov, tr, steps):
    """The trainer's calls per step; (batch index, staleness) of each step."""
    seen = []
    for _ in range(steps):
        batch = ov.prompts({})
        ov.prefetch()
        seen.append((batch.index[0], ov.metrics()["rollout/staleness_max"]))
        tr.step += 1
    return seen


@pytest.mark.parametrize("k, stale", [(1, [0, 1, 1, 1, 1]), (2, [0, 1, 2, 2, 2]),
                                      (3, [0, 1, 2, 3, 3])])
def test_k_batches_in_flight(k, stale):
    tr = _trainer(k, 5)
    ov = Overlap(tr)
    seen = _run(ov, tr, 5)
    assert [s for _, s in seen] == stale and [b for b, _ in seen] == list(range(5))
    seed0 = tr.cfg.trainer.seed * 100_003
    assert tr.worker.requests == [seed0 + s for s in range(1, 5)]  # each later step's, once
    assert not ov.queue  # nothing requested past the last step


def test_checkpoint_holds_every_batch_in_flight():
    tr = _trainer(2, 6)
    ov = Overlap(tr)
    first = _run(ov, tr, 2)
    state = ov.state_dict()
    assert [b["version"] for b in state["batches"]] == [0, 1]
    assert [b["prompts"]["index"] for b in state["batches"]] == [[2], [3]]
    rest = _run(ov, tr, 4)
    tr2 = _trainer(2, 6)
    tr2.step, tr2.loader.next_batch = 2, iter([_batch(4), _batch(5)]).__next__
    ov2 = Overlap(tr2)
    ov2.load_state_dict(state)
    assert tr2.worker.kept == [{"seed": b["results"]["seed"]} for b in state["batches"]]
    assert _run(ov2, tr2, 4) == rest and first == [(0, 0.0), (1, 1.0)]


def test_the_k1_form_loads_one_step_stale():
    tr = _trainer(1, 4)
    tr.step = 2
    ov = Overlap(tr)
    fields = {f.name: getattr(_batch(7), f.name) for f in dataclasses.fields(PromptBatch)}
    ov.load_state_dict({"prompts": fields, "results": {"seed": 5}})
    assert ov.prompts({}).index == [7] and ov.stale == 1 and tr.worker.collected == [5]


def test_a_weight_sync_first_collects_the_batches_requested_before_it(monkeypatch):
    """Review of issue 39 (F2): the generation ranks take a sync after the batches requested
    before it, so at async_steps >= 2 (or after a validation) the sync's bridge sends waited,
    unbounded and unnamed, behind a generation. sync_weights now receives their lengths first
    (bounded by rollout.timeout_s, naming the replica): a hung replica fails there, before any
    sync command is sent."""
    from hybridrl.rollout.split import remote
    from hybridrl.rollout.split.link import GenerationTimeout

    rr = remote.RemoteRollout.__new__(remote.RemoteRollout)
    rr.outstanding, rr.kept, sent = [(7, [[1, 2]]), (8, [[3]])], {}, []
    rr.hand, rr.sources, rr.timeout_s, rr.device = None, [1], 3.0, "cpu"
    rr.who = lambda src: f"generation rank {src}"

    def hung(*args, **kwargs):
        raise GenerationTimeout("no generated batch from generation rank 1 (replica 0 of 1)")

    monkeypatch.setattr(remote, "recv_lengths", hung)
    monkeypatch.setattr(rr, "_command", sent.append, raising=False)
    with pytest.raises(GenerationTimeout, match="generation rank 1"):
        rr.sync_weights(actor=None)
    assert sent == []  # no sync command went out behind the hung batch


def test_forgotten_results_are_dropped_on_the_generation_ranks(monkeypatch):
    """Review of issue 39 (F4): a KL-guard rollback reloads the checkpoint's in-flight batches
    (keep); results collected since then, whose rows still wait on the generation ranks, were
    forgotten on the training side only and stayed held there for the rest of the run. Each is
    now dropped there with a handoff to no training rank (a batch held locally needs none)."""
    import torch

    from hybridrl.rollout.base import GenerationOutput
    from hybridrl.rollout.split import remote

    rr = remote.RemoteRollout.__new__(remote.RemoteRollout)
    out = GenerationOutput(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long),
                           torch.zeros(1, 2))
    rr.outstanding, rr.dp_of, sent = [], [0, 0, 1], []
    rr.kept = {7: remote.Results([[1]], [2], 0.0, 0.0, 1),  # rows on the generation ranks
               8: remote.Results([[1]], [2], 0.0, 0.0, 1, local=out)}  # from a checkpoint
    monkeypatch.setattr(rr, "_command", sent.append, raising=False)
    rr.keep([])
    assert [(c.op, c.seed, c.drop, c.dp_of) for c in sent] == [("handoff", 7, True,
                                                                [None, None, None])]
    assert rr.kept == {}
