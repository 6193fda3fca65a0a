"""Sharded checkpoints (hybridrl.checkpoint.checkpointer) on gloo ranks, checked against runs that
never stopped.

- 8 ranks, from an HF checkpoint, greedy rollouts (layout-invariant): a 3-step run at
  (t, p, d) = (2, 2, 2); a 2-step run saving every step with async save; resumed from its
  global_step_2 at (2, 2, 2) (step 3 bit for bit), (1, 2, 4), (2, 1, 4) and (1, 1, 8) (step 3
  within fp32 tolerance); every rank wrote one file, the index covers every parameter once;
  ``hybridrl export`` of the checkpoint gives transformers log-probs equal to the trainer's;
  a byte flipped in one rank's file of global_step_2: auto-resume names the file, warns, falls
  back to global_step_1 and ends with the uninterrupted run's metrics.
- 1 rank: ``max_ckpt_to_keep``; a truncated file named on an explicit resume; the KL guard in
  both modes with an injected spike, and its limit in checkpoint mode.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from hybridrl.testing.dist import run_on_ranks
from tests.distributed import test_checkpoint_cases as cases_mod
from tests.distributed.test_trainer import _save_hf
from tests.distributed.test_trainer_cases import run_in

BATCH = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=4",
         "critic.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=1",
         "critic.ppo_micro_batch_size_per_gpu=1", "ref.log_prob_micro_batch_size_per_gpu=1"]
GAE = ["algorithm.adv_estimator=gae", "actor.use_kl_loss=true"]
NOT_COMPARED = ("actor/lr", "critic/lr")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    return str(path), _save_hf(path / "hf")


def _layout(t, p):
    return [f"parallel.tp={t}", f"parallel.pp={p}"]


@pytest.fixture(scope="module")
def world8(root):
    r, hf = root
    base = [*BATCH, *GAE, f"model.path={hf}", "model.tokenizer_path=char",
            "rollout.temperature=0", "parallel.gen.tp=1"]
    ck = lambda name: run_in(f"{r}/{name}")  # noqa: E731
    from_2 = ["trainer.resume=path", f"trainer.resume_path={r}/save/checkpoints/global_step_2"]
    cases = [("full3", [*base, *_layout(2, 2), *ck("full3"), "trainer.total_steps=3"], "fit",
              None),
             ("save2", [*base, *_layout(2, 2), *ck("save"), "trainer.save_freq=1",
                        "trainer.async_save=true"], "fit", None)]
    for t, p in ((2, 2), (1, 2), (2, 1), (1, 1)):
        cases.append((f"at{t}{p}", [*base, *_layout(t, p), *ck(f"at{t}{p}"), *from_2,
                                    "trainer.total_steps=3", "trainer.save_freq=1"], "fit", None))
    cases.append(("logprobs", [*base, *_layout(2, 2), *ck("lp"), "trainer.resume=path",
                               f"trainer.resume_path={r}/at11/checkpoints/global_step_3",
                               "trainer.total_steps=3"], "logprobs", None))
    cases.append(("corrupt", [*base, *_layout(2, 2), *ck("save"), "trainer.total_steps=3",
                              "trainer.save_freq=1"], "corrupt",
                  (f"{r}/save/checkpoints/global_step_2/rank_00003.pt", "flip")))
    return run_on_ranks(cases_mod.run_cases, 8, r, cases, timeout=900,
                        preload=("megatron.core",))


def _close(got: dict, want: dict, rtol=2e-4, atol=2e-5):
    assert set(got) == set(want)
    bad = {k: (got[k], want[k]) for k in want if k not in NOT_COMPARED
           and not math.isclose(got[k], want[k], rel_tol=rtol, abs_tol=atol)}
    assert not bad, bad


@pytest.mark.slow
def test_resume_at_other_layouts_continues_the_run(world8, root):
    for rank in range(8):
        full = world8[rank]["full3"]["metrics"]
        assert world8[rank]["save2"]["metrics"] == full[:2]
        assert world8[rank]["at22"]["metrics"] == [full[2]]  # same layout: bit for bit
        for name in ("at12", "at21", "at11"):
            got = world8[rank][name]["metrics"]
            assert len(got) == 1 and got[0] != full[2], name  # really another layout
            _close(got[0], full[2])
    assert any("resharded onto this layout" in line for line in world8[0]["at11"]["lines"])


@pytest.mark.slow
def test_every_rank_writes_its_part_once(world8, root):
    ckpt = f"{root[0]}/at11/checkpoints/global_step_3"
    files = sorted(os.listdir(ckpt))
    assert files == sorted(["COMPLETE", "index.json", "meta.json", "trainer_state.pt",
                            *[f"rank_{r:05d}.pt" for r in range(8)]])
    index = json.load(open(f"{ckpt}/index.json"))
    for role in ("actor", "critic"):
        for name, pieces in index["models"][role].items():
            # dp 8, tp 1: eight ranges that tile the parameter exactly once
            spans = sorted((p["start"], p["end"]) for p in pieces)
            numel = math.prod(pieces[0]["shape"])
            assert spans[0][0] == 0 and spans[-1][1] == numel, name
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), name
    sizes = [index["files"][f"rank_{r:05d}.pt"]["bytes"] for r in range(8)]
    assert max(sizes) < 0.3 * sum(sizes)  # no rank funnels the state


@pytest.mark.slow
def test_export_logprobs_equal_the_trainer(world8, root, tmp_path):
    from transformers import AutoModelForCausalLM

    from hybridrl.cli import main

    out = tmp_path / "actor"
    # the logprobs case loaded at11's global_step_3 (written at (1, 1, 8)) at (2, 2, 2)
    assert main(["export", f"{root[0]}/at11/checkpoints/global_step_3", "--role", "actor",
                 "--out", str(out)]) == 0
    assert main(["export", f"{root[0]}/at11/checkpoints/global_step_3", "--role", "critic",
                 "--out", str(tmp_path / "critic"), "--dtype", "bf16"]) == 0
    critic = json.load(open(tmp_path / "critic" / "config.json"))
    assert critic["num_labels"] == 1 and critic["torch_dtype"] == "bfloat16"
    got = world8[0]["logprobs"]
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    for i, (prompt, resp, mask) in enumerate(zip(got["prompts"], got["responses"],
                                                 got["mask"])):
        n = int(mask.sum())
        ids = torch.tensor([list(prompt) + resp[:n].tolist()])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        want = lp[len(prompt) - 1: len(prompt) - 1 + n].gather(1, ids[0, len(prompt):, None])[:, 0]
        torch.testing.assert_close(got["logprobs"][i, :n], want, atol=2e-5, rtol=2e-5)


@pytest.mark.slow
def test_corrupt_shard_falls_back_to_the_previous_checkpoint(world8, root):
    res = world8[0]["corrupt"]
    warn = [line for line in res["lines"] if "warning" in line]
    assert len(warn) == 1 and "rank_00003.pt" in warn[0] and "CRC-32" in warn[0]
    assert "falling back to" in warn[0] and warn[0].endswith("global_step_1")
    full = world8[0]["full3"]["metrics"]
    assert res["metrics"] == full[1:]  # steps 2 and 3 as if nothing happened
    # the run folder: step 2's first line (after global_step_1, run again) moved aside, not lost
    folder = f"{root[0]}/save"
    steps = [json.loads(line)["step"] for line in open(f"{folder}/metrics.jsonl")]
    assert steps == [1, 2, 3]
    assert [json.loads(line)["step"] for line in open(f"{folder}/metrics.redone.jsonl")] == [2]
    assert any("1 lines of steps after 1" in line and "metrics.redone.jsonl" in line
               for line in res["lines"])


@pytest.fixture(scope="module")
def world1(root):
    r, hf = root
    base = [*GAE, f"model.path={hf}", "model.tokenizer_path=char", "rollout.temperature=0"]
    ck = lambda name: run_in(f"{r}/w1_{name}")  # noqa: E731
    spike = [*base, "trainer.kl_guard.max_kl=1e6", "trainer.total_steps=3"]
    cases = [
        ("keep", [*base, *ck("keep"), "trainer.save_freq=1", "trainer.total_steps=3",
                  "trainer.max_ckpt_to_keep=2"], "fit", None),
        ("truncated", [*base, *ck("keep"), "trainer.total_steps=4", "trainer.resume=path",
                       f"trainer.resume_path={r}/w1_keep/checkpoints/global_step_3"], "corrupt",
         (f"{r}/w1_keep/checkpoints/global_step_3/rank_00000.pt", "truncate")),
        ("all_corrupt", [*base, *ck("keep"), "trainer.save_freq=1", "trainer.total_steps=4",
                         "trainer.max_ckpt_to_keep=2"], "corrupt",  # step 3 truncated above
         [(f"{r}/w1_keep/checkpoints/global_step_2/rank_00000.pt", "flip")]),
        ("step_mode", [*spike, *ck("stepmode")], "spike", [2]),
        ("ckpt_mode", [*spike, *ck("ckptmode"), "trainer.kl_guard.mode=checkpoint",
                       "trainer.save_freq=1"], "spike", [2]),
        ("ckpt_limit", [*spike, *ck("limit"), "trainer.kl_guard.mode=checkpoint",
                        "trainer.kl_guard.max_rollbacks=2"], "spike", "always"),
    ]
    return run_on_ranks(cases_mod.run_cases, 1, r, cases, timeout=600,
                        preload=("megatron.core",))[0]


def test_keep_and_truncated(world1, root):
    assert sorted(os.listdir(f"{root[0]}/w1_keep/checkpoints")) == [
        "global_step_2", "global_step_3"]
    assert any("removed global_step_1" in line for line in world1["keep"]["lines"])
    err = world1["truncated"]["error"]  # an explicit path: no fallback, the file is named
    assert "rank_00000.pt' cannot be read" in err and "bytes, index.json says" in err
    # resume=auto with every complete checkpoint corrupt: one line (no fallback warnings first)
    every = world1["all_corrupt"]
    assert "global_step_3/rank_00000.pt' cannot be read" in every["error"]
    assert "(and the 1 older complete checkpoints failed too)" in every["error"]
    assert not [line for line in every["lines"] if "warning" in line], every["lines"]


def test_kl_guard_modes(world1):
    step = world1["step_mode"]
    assert step["error"] is None and len(step["metrics"]) == 3
    assert [m["training/rolled_back"] for m in step["metrics"]] == [0.0, 1.0, 0.0]
    assert "training/kl_guard_lr" not in step["metrics"][0] and step["lr"] == 1.0
    ck = world1["ckpt_mode"]
    assert ck["error"] is None and len(ck["metrics"]) == 4  # step 2 spiked, then replayed
    # the multiplier each step trained with: step 2 spiked at 1.0, the replays ran at 0.5
    assert [m["training/kl_guard_lr"] for m in ck["metrics"]] == [1.0, 1.0, 0.5, 0.5]
    assert ck["lr"] == ck["critic_lr"] == 0.5
    assert ck["metrics"][2]["actor/lr"] == pytest.approx(0.5 * ck["metrics"][0]["actor/lr"])
    assert any("restored global_step_1, lr x 0.5" in line for line in ck["lines"])
    limit = world1["ckpt_limit"]
    assert limit["error"] is not None and "step 1: policy KL 1e+09 > max_kl" in limit["error"]
    assert "max_rollbacks=2" in limit["error"]
    restored = [line for line in limit["lines"] if "restored global_step_0" in line]
    assert len(restored) == 2 and "lr x 0.25" in restored[1]
