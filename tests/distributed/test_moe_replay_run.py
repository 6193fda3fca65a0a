"""Routing replay in a real colocated run (issue 38 item 5 end to end): the builtin tiny MoE of
configs/demo_moe.yaml on 2 gloo ranks (ep 2, dp 2), ``actor.router_replay=rollout``.

The engine's top-k expert ids of each row travel with the row to the DP replica that trains on
it (``partition.exchange_rollouts(routing=...)``, int16 as bytes) and land on
``RolloutBatch.routed_experts``; the old log-prob forward and the update replay them. Checked:
the step runs (without the hand-off it stops at step 1 with "carries no routed expert ids"),
every received row holds k distinct expert ids in [0, E) on each of its prompt + response tokens
but the last (never run) and -1 past them, each row lands on one replica, and the trainer's own
routing agrees with the replayed one on the unperturbed weights (``actor/router_agreement``
1.0: ids misplaced in the hand-off would disagree), also after DAPO dynamic sampling's
re-balance over the DP replicas (``algorithm.filter_groups``), which moves the ids as well. The run's checkpoint (plain optimizer,
``actor.use_distributed_optimizer=false``) then resumes at ep 1 with every expert's weights as
saved (the dense "parameter i saved by DP rank i % dp" rule dropped half the experts at ep 2).
"""

from __future__ import annotations

import os

import pytest

from hybridrl.testing.dist import run_on_ranks
from tests.distributed.test_trainer_cases import run_in

DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "demo_moe.yaml")


def _rank(rank, world, tmp):
    import warnings

    import torch

    from hybridrl.config import load_config
    from hybridrl.parallel.groups import build_groups
    from hybridrl.train import build_layout
    from hybridrl.trainer.ppo import PPOTrainer

    warnings.filterwarnings("ignore")
    seen = {}

    class Recording(PPOTrainer):
        def _rollout(self, prompts):  # the first rollout: after any resume, before any update
            if "weights" not in seen:
                from hybridrl.models.naming import named_local_parameters

                seen["weights"] = {n: p.detach().clone()
                                   for n, p in named_local_parameters(self.actor)}
            rb = super()._rollout(prompts)
            seen.setdefault("rb", rb)
            return rb

    from hybridrl.models.naming import named_local_parameters

    def run(steps, folder, *extra):
        seen.clear()
        cfg = load_config([DEMO], [
            f"trainer.total_steps={steps}", "trainer.save_freq=1",
            "trainer.test_freq=-1", "trainer.logger=[console]", "trainer.kl_guard.max_kl=0",
            "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
            "actor.use_distributed_optimizer=false", f"data.synthetic.dir={tmp}/data",
            *run_in(f"{tmp}/{folder}"), *extra], world_size=world)
        train, gen = build_layout(cfg, world)
        torch.manual_seed(cfg.trainer.seed)
        tr = Recording(cfg, build_groups(train, gen), print_fn=lambda *a, **k: None)
        hist = tr.fit()
        return tr, hist

    tr, hist = run(1, "run", "actor.router_replay=rollout")
    rb = seen["rb"]
    saved = {n: p.detach().clone() for n, p in named_local_parameters(tr.actor)}
    out = {"metrics": hist[-1], "rows": rb.rows, "routed": rb.routed_experts,
           "lens": rb.response_lengths.tolist(), "prompts": [len(p) for p in rb.prompt_ids],
           "ep": tr.groups.ep_size, "saved": saved}
    # DAPO dynamic sampling at dp 2: its re-balance moves each kept row's routed ids too (it
    # moved ids and log-probs only: the update stopped with "carries no routed expert ids")
    _, dapo = run(1, "dapo", "actor.router_replay=rollout", "algorithm.filter_groups.enable=true",
                  "algorithm.filter_groups.max_num_gen_batches=2")
    out["dapo"] = dapo[-1]
    # the checkpoint (plain optimizer: each expert on the rank of its EP group) resumed at ep 1
    tr, _ = run(2, "at_ep1", "parallel.ep=1", "trainer.resume=path",
                f"trainer.resume_path={tmp}/run/checkpoints/global_step_1")
    out["loaded"] = seen["weights"]
    out["ep_resumed"] = tr.groups.ep_size
    return out


@pytest.mark.slow
def test_router_replay_runs_colocated_with_the_ids_handed_off(tmp_path):
    import torch

    res = run_on_ranks(_rank, 2, str(tmp_path), timeout=600, preload=("megatron.core",))
    for r in res:
        m = r["metrics"]
        assert m["actor/router_agreement"] == pytest.approx(1.0), m.get("actor/router_agreement")
        d = r["dapo"]
        assert d["dynamic_sampling/rounds"] >= 1
        assert d["actor/router_agreement"] == pytest.approx(1.0), d.get("actor/router_agreement")
        routed = r["routed"]
        assert routed is not None and routed.dtype == torch.int16
        for j, (p, n) in enumerate(zip(r["prompts"], r["lens"])):
            span = routed[j, :p + n - 1]  # the last token is never run: -1 there
            assert bool((span >= 0).all()) and bool((span < 8).all()), (j, span)
            assert bool((routed[j, p + n:] == -1).all())
            assert span.shape[-1] == 2 and bool((span[..., 0] != span[..., 1]).all())
    assert sorted(res[0]["rows"] + res[1]["rows"]) == list(range(8))  # each row on one replica
    # a checkpoint written at ep 2 by the plain optimizer holds every expert (each rank's own:
    # was half of them, the dense "parameter i on DP rank i % dp" rule) and loads at ep 1
    assert [r["ep"] for r in res] == [2, 2] and [r["ep_resumed"] for r in res] == [1, 1]
    saved = {**res[0]["saved"], **res[1]["saved"]}
    from hybridrl.models.naming import expert_index

    assert {expert_index(n) for n in saved} - {None} == set(range(8))  # both ranks' halves
    assert {expert_index(n) for n in res[0]["saved"]} - {None} == set(range(4))  # ep 2
    for r in res:
        assert set(r["loaded"]) == set(saved)
        for name, w in r["loaded"].items():
            assert torch.equal(w, saved[name]), name
