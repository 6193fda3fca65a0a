"""The PPO loop end to end on gloo ranks: 1 rank and 2 ranks (dp = 2, tp = 2 with gen tp 2 or 1).

One ``run_on_ranks`` call per world size runs every case of that world (``test_trainer_cases``).
Checked here, in the parent:
- 2-step runs complete with finite metrics under the DESIGN.md key names (GAE with critic,
  KL loss, in-reward KL with the adaptive controller, dynamic micro-batches, GRPO);
- the same seed gives identical metrics twice;
- kill-and-resume: 2 steps with save_freq=1, then a new trainer resuming (resume=auto) for step
  3, gives the step-3 metrics of an uninterrupted 3-step run;
- KL guard: with a tiny max_kl the step is rolled back (actor parameters and optimizer step count
  equal those before it); too many rollbacks, or rollback disabled, stop with a clear error;
- a Qwen2 checkpoint (q/k/v biases) trains, and the builtin engine's log-probs equal megatron's;
- a reward model (HF LlamaForTokenClassification) scores each row at its last response token as
  transformers does, at tp 1 and 2, and drives a 2-step run;
- layouts: from the same HF checkpoint with greedy rollouts (layout-invariant), dp = 2,
  tp = 2 (gen tp 2: engine TP all-reduces), tp = 2 with gen tp 1 (two micro-DP replicas; also
  with the HybridFlow-V grouping, which the p2p reshard serves) and,
  on 4 ranks, tp = 2 x pp = 2 with gen tp 2 (dynamic micro-batches) give the single-process
  metrics of both steps within float tolerance; dp = 2 kill-and-resume writes each optimizer range
  once and resumes exactly.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from hybridrl.testing.dist import run_on_ranks
from tests.distributed import test_trainer_cases as cases_mod
from tests.distributed.test_trainer_cases import run_in

GAE = ["algorithm.adv_estimator=gae", "actor.use_kl_loss=true"]
GRPO = ["algorithm.adv_estimator=grpo", "actor.use_kl_loss=true", "rollout.temperature=1.0"]
GUARD = ["trainer.kl_guard.max_kl=1e-12"]
OFFLOAD = [f"{role}.{part}_offload=true" for role in ("actor", "critic")
           for part in ("param", "grad", "optimizer")] + ["ref.param_offload=true"]
NOT_COMPARED = ("actor/lr", "critic/lr")
CK = "trainer.checkpoint_dir"


def _save_hf(folder, qwen2=False):
    import transformers

    torch.manual_seed(0)
    config_cls, model_cls = ((transformers.Qwen2Config, transformers.Qwen2ForCausalLM) if qwen2
                             else (transformers.LlamaConfig, transformers.LlamaForCausalLM))
    model = model_cls(config_cls(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=96,
        tie_word_embeddings=False, rms_norm_eps=1e-5))
    with torch.no_grad():  # a less uniform policy than the default init
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return str(folder)


def _save_reward_model(folder):
    """A tiny HF reward model: LlamaForTokenClassification with one label (verl's RM format)."""
    from transformers import LlamaConfig, LlamaForTokenClassification

    torch.manual_seed(1)
    model = LlamaForTokenClassification(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=96, num_labels=1,
        rms_norm_eps=1e-5))
    with torch.no_grad():
        model.score.weight.mul_(20.0)  # scores of order 1, so a wrong position shows
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("trainer")
    _save_hf(path / "qwen2", qwen2=True)  # q/k/v biases: megatron add_qkv_bias, engine bias
    _save_reward_model(path / "rm")
    return str(path), _save_hf(path / "hf")


def _rm(root, name, extra=()):
    return [*_hf(root, name, extra), f"reward.reward_model_path={root[0]}/rm"]


def _hf(root, name, extra=()):
    r, hf = root
    return [f"model.path={hf}", "model.tokenizer_path=char", "rollout.temperature=0",
            *GAE, *run_in(f"{r}/{name}"), *extra]


@pytest.fixture(scope="module")
def world1(root):
    r, _ = root
    ck = lambda name: run_in(f"{r}/{name}")  # noqa: E731
    cases = [
        ("a", [*GAE, *ck("a")], "fit"),
        ("b", [*GAE, *ck("b")], "fit"),
        ("full3", [*GAE, *ck("full3"), "trainer.total_steps=3"], "fit"),
        ("save2", [*GAE, *ck("resume"), "trainer.save_freq=1"], "fit"),
        ("resume", [*GAE, *ck("resume"), "trainer.total_steps=3"], "fit"),
        ("grpo", [*GRPO, *ck("grpo"), "trainer.test_freq=2", "actor.use_dynamic_bsz=true",
                  "actor.ppo_max_token_len_per_gpu=160"], "fit"),
        ("gae_kl_in_reward", [*GAE, *ck("klr"), "algorithm.use_kl_in_reward=true",
                              "algorithm.kl_ctrl.type=adaptive", "actor.use_dynamic_bsz=true",
                              "critic.use_dynamic_bsz=true", "ref.log_prob_use_dynamic_bsz=true",
                              "actor.ppo_max_token_len_per_gpu=200",
                              "critic.ppo_max_token_len_per_gpu=200",
                              "ref.log_prob_max_token_len_per_gpu=200"], "fit"),
        ("guard", [*GAE, *GUARD, *ck("guard"), "trainer.kl_guard.max_rollbacks=5"], "guard"),
        ("giveup", [*GAE, *GUARD, *ck("giveup"), "trainer.kl_guard.max_rollbacks=1"], "error"),
        ("no_rollback", [*GAE, *GUARD, *ck("norb"), "trainer.kl_guard.rollback=false"], "error"),
        ("hf", _hf(root, "hf1"), "fit"),
        ("qwen2", [*_hf(root, "qwen2"), f"model.path={root[0]}/qwen2"], "fit"),
        ("rm_scores", _rm(root, "rm1"), "rm"),
        ("rm_fit", _rm(root, "rmfit", ["rollout.temperature=1.0"]), "fit"),
    ]
    return run_on_ranks(cases_mod.run_cases, 1, r, cases, timeout=400,
                        preload=("megatron.core",))[0]


@pytest.fixture(scope="module")
def world2(root):
    r, _ = root
    cases = [
        ("dp2", _hf(root, "dp2"), "fit"),
        ("tp2", _hf(root, "tp2", ["parallel.tp=2", "parallel.gen.tp=2"]), "fit"),
        ("tp2_rm_scores", _rm(root, "tp2rm", ["parallel.tp=2", "parallel.gen.tp=2"]), "rm"),
        ("tp2_gen1", _hf(root, "tp2g1", ["parallel.tp=2", "parallel.gen.tp=1"]), "fit"),
        ("tp2_vanilla_p2p", _hf(root, "tp2v", ["parallel.tp=2", "parallel.gen.grouping=vanilla"]),
         "fit"),
        ("grpo_dp2", [*GRPO, *run_in(f"{r}/grpo2"),
                      "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=160"], "fit"),
        # dp = 2: one model shard file written by DP rank 0, resumed by both ranks
        ("dp2_full3", _hf(root, "dp2f3", ["trainer.total_steps=3"]), "fit"),
        # an explicit trainer.checkpoint_dir: checkpoints there, the rest in the run folder
        ("dp2_save2", _hf(root, "dp2r", ["trainer.save_freq=1", f"{CK}={r}/ck"]), "fit"),
        ("dp2_resume", _hf(root, "dp2r", ["trainer.total_steps=3", f"{CK}={r}/ck"]), "fit"),
        ("dp2_offload", _hf(root, "dp2off", [*OFFLOAD]), "offload"),
    ]
    return run_on_ranks(cases_mod.run_cases, 2, r, cases, timeout=400,
                        preload=("megatron.core",))


@pytest.fixture(scope="module")
def world4(root):
    r, _ = root
    cases = [("3d", _hf(root, "3d", ["parallel.tp=2", "parallel.pp=2", "parallel.gen.tp=2",
                                     "actor.use_dynamic_bsz=true",
                                     "actor.ppo_max_token_len_per_gpu=200"]), "fit")]
    return run_on_ranks(cases_mod.run_cases, 4, r, cases, timeout=400,
                        preload=("megatron.core",))


def _close(got: dict, want: dict, rtol=2e-4, atol=2e-5):
    assert set(got) == set(want)
    bad = {k: (got[k], want[k]) for k in want if k not in NOT_COMPARED
           and not math.isclose(got[k], want[k], rel_tol=rtol, abs_tol=atol)}
    assert not bad, bad


KEYS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/entropy",
        "actor/grad_norm", "critic/vf_loss", "critic/score/mean", "response_length/mean",
        "timing_s/gen", "timing_s/reshard", "timing_s/ref", "timing_s/values", "timing_s/adv",
        "timing_s/update_actor", "timing_s/update_critic", "timing_s/step", "perf/throughput")


@pytest.mark.slow
def test_one_rank_runs_and_logs(world1, root):
    res = world1["a"]
    assert res["finite"] and res["changed"] and len(res["metrics"]) == 2
    assert res["lines"][0].startswith("hybridrl: world 1") and res["lines"][-1].startswith("step 2/2")
    assert f"run folder {root[0]}/a" in res["lines"][0]
    # the run folder: <output_dir>/<experiment_name>, no checkpoint (save_freq=-1)
    assert sorted(os.listdir(f"{root[0]}/a")) == [".hybridrl.lock", "config.yaml", "metrics.jsonl",
                                                  "run.json"]  # the lock: run_lock.py
    assert "experiment_name: a" in open(f"{root[0]}/a/config.yaml").read()
    lines = open(f"{root[0]}/a/metrics.jsonl").read().splitlines()
    logged = [json.loads(line) for line in lines]
    assert [m["step"] for m in logged] == [1, 2]
    missing = [k for k in KEYS if k not in logged[0]]
    assert not missing, missing
    # the engine's log-probs are the actor's recomputed ones (fp32)
    assert all(m["training/rollout_logprob_diff_max"] < 1e-5 for m in logged)
    for name in ("grpo", "gae_kl_in_reward"):
        assert world1[name]["finite"] and len(world1[name]["metrics"]) == 2, name
    grpo = f"{root[0]}/grpo"  # validated at step 2: its samples in generations.jsonl
    assert sorted(os.listdir(grpo)) == [".hybridrl.lock", "config.yaml", "generations.jsonl",
                                        "metrics.jsonl", "run.json"]
    samples = [json.loads(line) for line in open(f"{grpo}/generations.jsonl")]
    assert len(samples) == 8 and {s["step"] for s in samples} == {2}  # data.synthetic.val_size
    assert {"prompt", "response", "ground_truth", "score"} <= set(samples[0])
    assert "val/score/mean" in world1["grpo"]["metrics"][1]
    assert "actor/reward_kl_penalty" in world1["gae_kl_in_reward"]["metrics"][0]


@pytest.mark.slow
def test_qwen2_biases_reach_the_engine(world1):
    """A Qwen2 checkpoint: megatron trains with q/k/v biases and the builtin engine, fed by the
    reshard (biases included), samples with the same log-probs as megatron recomputes."""
    got = world1["qwen2"]
    assert got["finite"] and got["changed"] and len(got["metrics"]) == 2
    assert all(m["training/rollout_logprob_diff_max"] < 1e-5 for m in got["metrics"])
    assert got["metrics"] != world1["hf"]["metrics"]  # not silently the llama folder


def _hf_reward(folder, seqs):
    """transformers' reward: the token-classification logit at each sequence's last token."""
    from transformers import LlamaForTokenClassification

    model = LlamaForTokenClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return torch.tensor([float(model(torch.tensor([s])).logits[0, -1, 0]) for s in seqs])


def test_reward_model_scores_the_last_response_token(world1, world2, root):
    def check(res):
        # empty responses score 0; the others end at different positions
        empty = [n == 0 for n in res["lengths"]]
        assert any(empty) and len({len(s) for s in res["seqs"]}) > 2
        assert all(float(s) == 0 for s, e in zip(res["scores"], empty) if e)
        rows = [i for i, e in enumerate(empty) if not e]
        want = _hf_reward(f"{root[0]}/rm", [res["seqs"][i] for i in rows])
        assert want.abs().max() > 0.1  # not trivially zero
        torch.testing.assert_close(res["scores"][rows], want, atol=2e-5, rtol=2e-5)
        mean = float(res["scores"].mean())
        assert res["metrics"]["critic/score/mean"] == pytest.approx(mean, abs=1e-6)

    check(world1["rm_scores"])
    for rank in (0, 1):  # tp = 2: the sharded trunk scores the same sequences alike
        check(world2[rank]["tp2_rm_scores"])
    fit = world1["rm_fit"]
    assert fit["finite"] and fit["changed"] and len(fit["metrics"]) == 2
    assert "reward/raw_score/mean" not in fit["metrics"][0]  # the rule scorer did not run


def test_same_seed_same_metrics(world1):
    assert world1["a"]["metrics"] == world1["b"]["metrics"]


@pytest.mark.slow
def test_resume_gives_the_uninterrupted_step(world1, root):
    full, resumed = world1["full3"]["metrics"], world1["resume"]["metrics"]
    assert world1["save2"]["metrics"] == full[:2]
    assert len(resumed) == 1 and "resumed from" in world1["resume"]["lines"][0]
    assert resumed[0] == full[2]
    folder = f"{root[0]}/resume"
    assert os.path.isfile(f"{folder}/.hybridrl.lock")  # the run-folder lock (run_lock.py)
    names = sorted(n for n in os.listdir(folder) if n != ".hybridrl.lock")
    # the first start's config.yaml (total_steps 2) is kept beside the resumed one's
    assert len(names) == 5 and names[0] == "checkpoints" and names[1].startswith("config-")
    assert names[2:] == ["config.yaml", "metrics.jsonl", "run.json"], names
    assert "total_steps: 2" in open(f"{folder}/{names[1]}").read()
    assert "total_steps: 3" in open(f"{folder}/config.yaml").read()
    assert sorted(os.listdir(f"{folder}/checkpoints")) == ["global_step_1", "global_step_2"]
    logged = [json.loads(line) for line in open(f"{folder}/metrics.jsonl")]
    assert [m["step"] for m in logged] == [1, 2, 3]  # the resumed run appends
    first = [{k: v for k, v in m.items() if k not in ("step", "kept")} for m in logged[:2]]
    assert cases_mod._clean(first) == world1["save2"]["metrics"]  # the first start's lines kept


@pytest.mark.slow
def test_kl_guard_rolls_back(world1):
    g = world1["guard"]
    assert g["rollback"] == 1.0 and g["same"] and g["logged"]
    assert g["n_models"] == 2  # GAE: the critic and its optimizer are restored too
    assert g["kl_final"] != 0.0  # the guard measured the updated weights, not only the epochs
    assert g["optim_steps"] == (0, 0)
    assert "giving up" in world1["giveup"] and "2 consecutive" in world1["giveup"]
    assert "rollback disabled" in world1["no_rollback"]


@pytest.mark.slow
def test_two_ranks_match_one(world1, world2):
    want = world1["hf"]["metrics"]
    assert world1["hf"]["changed"]
    for name in ("dp2", "tp2", "tp2_gen1", "tp2_vanilla_p2p"):
        for rank in (0, 1):
            got = world2[rank][name]
            assert got["finite"] and got["changed"], name
            # reshard -> engine on 2 ranks: engine log-probs = megatron's recomputed ones
            assert all(m["training/rollout_logprob_diff_max"] < 1e-5 for m in got["metrics"])
            for step in range(2):
                _close(got["metrics"][step], want[step])
    # reshard metrics: tp 2 -> gen tp 1 moves the partner's shard, merged into fewer messages
    # than transfers, the same at every step (the second replays the first); dp 2 moves nothing
    for rank in (0, 1):
        moved, none = world2[rank]["tp2_gen1"], world2[rank]["dp2"]
        assert moved["reshard"][0] == moved["reshard"][1], moved["reshard"]
        assert moved["reshard"][0]["reshard/recv_MB"] > 0
        assert 0 < moved["reshard"][0]["reshard/messages"] < moved["transfers"] / 2, moved
        assert none["reshard"][0] == {"reshard/recv_MB": 0.0, "reshard/sent_MB": 0.0,
                                      "reshard/messages": 0.0}
    assert world2[0]["grpo_dp2"]["finite"]
    assert world2[0]["grpo_dp2"]["metrics"] == world2[1]["grpo_dp2"]["metrics"]
    assert world2[0]["tp2"]["lines"][0].startswith("hybridrl: world 2, train tp 2")
    assert world2[1]["tp2"]["lines"] == []  # only rank 0 prints


def test_dp2_checkpoint_writes_each_part_once_and_resumes(world2, root):
    for rank in (0, 1):
        full, resumed = world2[rank]["dp2_full3"]["metrics"], world2[rank]["dp2_resume"]["metrics"]
        assert world2[rank]["dp2_save2"]["metrics"] == full[:2]
        assert len(resumed) == 1 and resumed[0] == full[2]
    # trainer.checkpoint_dir set: the checkpoints there, the run folder without checkpoints/
    assert sorted(os.listdir(f"{root[0]}/ck")) == ["global_step_1", "global_step_2"]
    assert sorted(os.listdir(f"{root[0]}/dp2r"))[-3:] == ["config.yaml", "metrics.jsonl",
                                                          "run.json"]
    assert "checkpoints" not in os.listdir(f"{root[0]}/dp2r")
    ckpt = f"{root[0]}/ck/global_step_2"
    assert sorted(os.listdir(ckpt)) == ["COMPLETE", "index.json", "meta.json",
                                        "rank_00000.pt", "rank_00001.pt", "trainer_state.pt"]
    index = json.load(open(f"{ckpt}/index.json"))
    mains = []  # each rank's file holds its DP half of the distributed optimizer's state
    for r in (0, 1):
        part = torch.load(f"{ckpt}/rank_{r:05d}.pt", weights_only=True)
        assert set(part) == {"format", "rng", "models"}
        mains.append(sum(t.numel() for role in part["models"].values()
                         for k, t in role.items() if k.endswith("/param")))
    stage = sum(math.prod(p[0]["shape"]) for role in index["models"].values()
                for p in role.values())
    assert sum(mains) == stage and max(mains) < 0.55 * stage


@pytest.mark.slow
def test_offload_keeps_the_numbers_and_frees_the_device(world2):
    """actor/critic params, grads, optimizer state and the reference's params live in host
    memory outside their phases; the run's metrics equal the run without offload bit for bit."""
    for rank in (0, 1):
        got = world2[rank]["dp2_offload"]
        assert got["metrics"] == world2[rank]["dp2"]["metrics"]
        full, seen, optim = got["full"], got["seen"], got["optim"]
        assert full["actor/params"] > 0 and full["reference/params"] > 0 and optim["actor"] > 0
        assert set(seen["gen"].values()) == {0}  # nothing of the training side while generating
        assert {"actor/optim", "critic/optim"} <= set(seen["gen"])
        for role, other in (("actor", "critic"), ("critic", "actor")):
            during = seen[f"update_{role}"]
            for part in ("params", "grads"):
                assert during[f"{role}/{part}"] == full[f"{role}/{part}"]  # all back, whole
                assert during[f"{other}/{part}"] == 0
            assert during[f"{role}/optim"] == optim[role] and during[f"{other}/optim"] == 0
            assert during["reference/params"] == 0


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "configs", "demo_cpu.yaml")


def _torchrun(args, cwd):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "hybridrl.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_entrypoint_runs_and_rejects_bad_config(root):
    r, _ = root
    overrides = [*cases_mod.base_overrides(r), *GRPO, "trainer.total_steps=1",
                 *run_in(f"{r}/cli"), "trainer.save_freq=1"]
    ok = _torchrun(["--config", DEMO, *overrides], r)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "step 1/1" in ok.stdout and ok.stdout.count("step 1/1") == 1  # rank 0 only
    assert os.path.isdir(f"{r}/cli/checkpoints/global_step_1")
    bad = _torchrun(["--config", DEMO, "actor.lr=-1"], r)
    assert bad.returncode != 0
    errors = [line for line in bad.stderr.splitlines() if line.startswith("hybridrl.train: error")]
    assert len(errors) == 1 and "actor.lr" in errors[0], bad.stderr[-2000:]
    assert "exitcode  : 2" in bad.stderr and "ValueError" not in bad.stderr  # no traceback


def test_checkpoint_folder_is_atomic_and_checked(tmp_path):
    from hybridrl.checkpoint.folder import (
        begin_folder,
        complete_checkpoints,
        finish_folder,
        latest_checkpoint,
        prune,
        read_file,
        read_json,
        write_file,
    )

    def save(step, value):
        tmp = begin_folder(tmp_path, step)
        info = write_file({"x": value}, tmp / "rank_00000.pt")
        return finish_folder(tmp_path, step, {"files": {"rank_00000.pt": info}}, {"step": step},
                             {"step": step})

    assert latest_checkpoint(tmp_path / "none") is None
    save(2, torch.ones(2))
    (tmp_path / "global_step_5").mkdir()  # a crash before COMPLETE: ignored
    (tmp_path / ".tmp_global_step_6").mkdir()
    latest = latest_checkpoint(tmp_path)
    assert latest == tmp_path / "global_step_2"
    index = read_json(latest, "index.json")
    assert torch.equal(read_file(latest, "rank_00000.pt", index["files"]["rank_00000.pt"])["x"],
                       torch.ones(2))
    assert read_file(latest, "trainer_state.pt", index["files"]["trainer_state.pt"]) == {"step": 2}
    save(2, torch.zeros(2))  # replaced whole
    assert torch.equal(read_file(latest, "rank_00000.pt")["x"], torch.zeros(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".tmp_global_step_6", "global_step_2", "global_step_5"]
    save(3, torch.ones(1))
    save(4, torch.ones(1))
    assert [p.name for p in complete_checkpoints(tmp_path)] == [
        "global_step_4", "global_step_3", "global_step_2"]
    assert [p.name for p in prune(tmp_path, 2)] == ["global_step_2"]
    assert prune(tmp_path, 0) == []  # 0 keeps all


@pytest.mark.slow
def test_3d_layout_matches_one_rank(world1, world4):
    """tp 2 x pp 2 (pipeline schedule, last-stage broadcast) with 2 gen replicas of gen tp 2."""
    want = world1["hf"]["metrics"]
    for rank in range(4):
        got = world4[rank]["3d"]
        assert got["finite"] and got["changed"]
        for step in range(2):
            _close(got["metrics"][step], want[step])
