"""Split placement's config, layout and plan (issue 29), no process group.

The config rules (one line naming the keys), the training world of a split run, and the
``hybridrl layout`` / ``hybridrl plan --gen-world`` reports: both rank sets, each generation
rank receiving exactly its engine shard, the sending balanced over the training ranks.
"""

from __future__ import annotations

import json

import pytest

from hybridrl.cli import main as cli_main
from hybridrl.config import load_config
from hybridrl.train import build_layout

SPLIT = ["parallel.placement=split", "parallel.gen.world=1"]


def test_split_config_trains_on_the_first_ranks():
    cfg = load_config([], [*SPLIT, "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
                           "critic.ppo_mini_batch_size=2",
                           "actor.ppo_micro_batch_size_per_gpu=1",
                           "critic.ppo_micro_batch_size_per_gpu=1"])
    assert cfg.parallel.split and cfg.parallel.train_world(3) == 2
    assert cfg.check_world(3) == 2  # dp over the 2 training ranks
    train, gen = build_layout(cfg, 3)
    assert train.world == 2 and gen is None


@pytest.mark.parametrize("overrides, words", [
    (["parallel.placement=split"], "parallel.gen.world >= 1"),
    (["parallel.placement=split", "parallel.gen.world=3", "parallel.gen.tp=2"], "multiple of"),
    (["parallel.gen.world=2"], "needs parallel.placement=split"),
    (["rollout.async_steps=1"], "rollout.async_steps=1 needs parallel.placement=split"),
    (["rollout.async_steps=-1"], "rollout.async_steps must be an integer >= 0"),
    (["rollout.async_steps=2"], "rollout.async_steps=2 needs parallel.placement=split"),
    (["parallel.placement=both"], "parallel.placement must be one of"),
    ([*SPLIT, "reshard.strategy=p2p"], "reshard.strategy must be 'auto'"),
    ([*SPLIT, "rollout.engine=sglang"], "rollout.engine=sglang needs trainer.device=cuda"),
    ([*SPLIT, "rollout.async_steps=1", "algorithm.filter_groups.enable=true", "rollout.n=2",
      "algorithm.adv_estimator=grpo"], "filter_groups"),
])
def test_bad_split_configs_fail_with_one_line(overrides, words):
    with pytest.raises(ValueError) as err:
        load_config([], overrides)
    assert words in str(err.value) and "\n" not in str(err.value).strip()


@pytest.mark.parametrize("builds, status", [(False, 2), (True, 1)])
def test_split_start_up_failure_is_bad_input(monkeypatch, capsys, tmp_path, builds, status):
    """A ValueError before a split rank's trainer / engine is built is start-up (2, as
    colocated); once built (fit_split's on_started), a training failure (1)."""
    import hybridrl.trainer.split_run as split_run
    from hybridrl.train import _run

    def fit_split(cfg, train, timeout_s, phases=None, on_started=None):
        if builds:
            on_started()
        raise ValueError("planted")

    monkeypatch.setattr(split_run, "fit_split", fit_split)
    cfg = load_config([], [*SPLIT, "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
                           "critic.ppo_mini_batch_size=2", f"trainer.output_dir={tmp_path}"])
    locks: list = []  # the run-folder locks rank 0 takes before building (released at exit)
    assert _run(cfg, None, None, None, 0, 10.0, locks) == status
    assert locks  # taken before the planted failure
    assert "planted" in capsys.readouterr().err


def test_split_needs_a_training_rank():
    cfg = load_config([], SPLIT)
    with pytest.raises(ValueError, match="leaves no training rank"):
        cfg.check_world(1)


def test_layout_shows_both_rank_sets(capsys):
    assert cli_main(["layout", "--world", "6", "--tp", "2", "--gen-world", "2", "--gen-tp", "2",
                     "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["train_ranks"] == [0, 1, 2, 3] and j["gen_ranks"] == [4, 5]
    assert j["train"]["tp"] == [[0, 1], [2, 3]] and j["gen"]["tp"] == [[4, 5]]
    assert cli_main(["layout", "--world", "6", "--gen-world", "2"]) == 0
    assert "generation ranks 4..5" in capsys.readouterr().out
    assert cli_main(["layout", "--world", "2", "--gen-world", "2"]) == 2


def test_plan_reports_bytes_per_rank_and_the_balance(capsys):
    argv = ["plan", "--model", "llama-3.1-8b", "--world", "16", "--tp", "4", "--gen-world", "8",
            "--gen-tp", "2", "--engine", "builtin"]
    assert cli_main([*argv, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["counted"] == "plan" and rep["gen"]["replicas"] == 4
    got = rep["received_per_gen_rank"]
    assert len(got) == 8 and got == got[:2] * 4  # each gen rank: its engine shard, ...
    # ... once: a replica receives the model (plus the training vocab padding rows it keeps)
    assert 0 <= sum(got[:2]) - rep["model_bytes"] < 1e-4 * rep["model_bytes"]
    assert sum(rep["sent_per_train_rank"]) == rep["total_bytes"] == sum(got)
    assert 1.0 <= rep["send_balance"] <= 1.10
    assert cli_main(argv) == 0
    assert "send balance (max / mean)" in capsys.readouterr().out


def test_placement_is_not_run_identity_but_async_is():
    from hybridrl.checkpoint.run_identity import run_id

    base = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
            "critic.ppo_mini_batch_size=2"]
    colocated = run_id(load_config([], base))
    assert run_id(load_config([], [*base, *SPLIT])) == colocated  # async 0: bit-equal runs
    assert run_id(load_config([], [*base, *SPLIT, "parallel.gen.world=2"])) == colocated
    assert run_id(load_config([], [*base, *SPLIT, "rollout.async_steps=1"])) != colocated


def test_in_flight_batch_resumed_without_overlap_is_generated_again():
    """An async-1 checkpoint's batch in flight, loaded at async 0 (or colocated): the next step
    takes its prompts (the loader has moved past them), with one notice line."""
    import dataclasses
    import types

    import torch

    from hybridrl.data.dataset import PromptBatch
    from hybridrl.trainer.overlap import Overlap

    saved = PromptBatch(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
                        [[1, 2, 3], [4, 5, 6]], [[], []], ["a", "b"], ["s", "s"], [{}, {}],
                        ["", ""], [7, 8])
    fresh = dataclasses.replace(saved, index=[9, 10])
    lines = []
    tr = types.SimpleNamespace(cfg=load_config([], []), log=types.SimpleNamespace(
        line=lines.append), loader=types.SimpleNamespace(next_batch=lambda: fresh))
    ov = Overlap(tr)
    assert not ov.on
    fields = {f.name: getattr(saved, f.name) for f in dataclasses.fields(saved)}
    ov.load_state_dict({"prompts": fields, "results": {"seed": 5}})
    timing = {}
    assert ov.prompts(timing).index == [7, 8] and ov.stale == 0 and not timing
    assert ov.prompts(timing).index == [9, 10]  # then the loader's next
    assert len(lines) == 1 and "2 prompts" in lines[0] and "again" in lines[0]
    ov.load_state_dict(None)  # nothing in flight: nothing said
    assert ov.prompts(timing).index == [9, 10] and len(lines) == 1
