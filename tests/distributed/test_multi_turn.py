"""Multi-turn rollouts in the trainer (hybridrl.demo.MultiTurnPPOTrainer, colocated, DP 2).

2 gloo ranks, one launch, a random tiny model in the plain format: it ends a turn with '>' now
and then, so tails hold tool segments (the format's error output for a call it cannot parse).
Checked:
- the trainer's log-probs at the engine's weights equal the engine's on every model token
  (loss_mask), and the batch holds tool segments (tokens with loss_mask 0 inside the tail);
- the loss mask each DP rank derives equals the one the generating rank's loop recorded;
- resume: 1 step, a checkpoint, a resumed step 2 == 2 uninterrupted steps (metrics and
  weights), multi-turn metrics included;
- the ranks of one gen-TP group get the source's tool outputs (a tool that answers its own
  rank; engines with the builtin's ``tp_src`` and with SGLang's ``members``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridrl.testing.dist import run_on_ranks

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "demo_tools.yaml")


def _overrides(tmp, name, steps, extra=()):
    return ["data.train_files=[]", "data.val_files=[]", "data.synthetic.max_digits=2",
            "data.synthetic.train_size=32", "data.synthetic.val_size=8",
            f"data.synthetic.dir={tmp}/data", "data.train_batch_size=4", "rollout.n=2",
            "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2",
            "rollout.response_length=128", "model.max_position_embeddings=224",
            "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.logger=[console]",
            f"trainer.total_steps={steps}", f"trainer.output_dir={tmp}",
            f"trainer.experiment_name={name}", "trainer.save_freq=-1", *extra]


def _rank(rank, world, tmp):
    import warnings

    import torch

    from hybridrl.config import load_config
    from hybridrl.demo import MultiTurnPPOTrainer
    from hybridrl.parallel.groups import build_groups
    from hybridrl.train import build_layout

    warnings.filterwarnings("ignore")
    seen = {}

    class Recording(MultiTurnPPOTrainer):
        def _rollout(self, prompts):
            rb = super()._rollout(prompts)
            if "lp" not in seen:  # the engine's weights are the actor's now
                seen.update(lp=self._logprobs(self.actor, rb), rb=rb)
                inner = self.worker._worker.engine
                seen["inner"] = type(inner).__name__
            return rb

    def build(name, steps, extra=(), cls=MultiTurnPPOTrainer):
        cfg = load_config([CONFIG], _overrides(tmp, name, steps, extra), world_size=world)
        train, gen = build_layout(cfg, world)
        torch.manual_seed(cfg.trainer.seed)
        return cls(cfg, build_groups(train, gen), print_fn=lambda *a, **k: None)

    def weights(tr):
        return {n: p.detach().clone() for n, p in tr.actor.module.named_parameters()}

    out = {}
    tr = build("straight", 2, cls=Recording)
    out["straight"] = tr.fit()
    out["straight_w"] = weights(tr)
    rb, lp = seen["rb"], seen["lp"]
    out["inner"] = seen["inner"]
    out["lp_gap"] = float(((lp - rb.rollout_logprobs).abs() * rb.loss_mask).max())
    out["model_tokens"] = int(rb.loss_mask.sum())
    out["tool_tokens"] = int((rb.response_mask - rb.loss_mask).sum())
    # the loop's own record on the generating rank equals the derived mask on the receiving one
    import dataclasses

    prompts = rb.prompt_ids * 4
    params = dataclasses.replace(tr.worker.sampling_params(128, 1.0),
                                 row_seeds=tuple(range(len(prompts))))
    from hybridrl.rollout.multi_turn.wrap import LoopEngine

    loop = LoopEngine(tr.worker._worker.engine, tr.worker.fmt, tr.worker.tools, tr.worker.budgets)
    tr.worker.sync_weights(tr.actor)
    rec = loop.generate(prompts, params)
    out["record_equal"] = bool(torch.equal(
        rec.loss_mask, tr.worker.loss_mask(rec.response_ids, rec.response_mask)))
    out["record_tool_tokens"] = int((rec.response_mask - rec.loss_mask).sum())
    gathered = tr.worker.generate(prompts, dataclasses.replace(params, row_seeds=None), seed=3)
    out["gathered"] = (gathered.response_ids, gathered.loss_mask, tr.worker.pop_metrics())
    out["rec_stats"] = rec.stats
    out["shared"] = _shared_tool_outputs(rank)
    save = ["trainer.save_freq=1", "trainer.resume=auto"]
    build("resumed", 1, save).fit()
    tr = build("resumed", 2, save)
    out["resumed"] = tr.fit()
    out["resumed_w"] = weights(tr)
    return out


def _shared_tool_outputs(rank):
    import torch
    import torch.distributed as dist

    from hybridrl.data.tokenizer import CharTokenizer
    from hybridrl.rollout.base import GenerationOutput, SamplingParams
    from hybridrl.rollout.multi_turn.format import build_format
    from hybridrl.rollout.multi_turn.wrap import Budgets, LoopEngine
    from hybridrl.tools import ToolRegistry

    tok = CharTokenizer()

    class RankTool:
        name, description, in_process, timeout_s = "rank", "this rank", True, 1.0
        parameters = {"type": "object", "required": ["x"], "properties": {"x": {"type": "string"}}}

        def call(self, arguments):
            return f"r{rank}"

    class TPEngine:  # one gen-TP group of both ranks, replaying a call then an answer
        def __init__(self, sglang_style):
            self.tp_group = dist.new_group([0, 1])
            if sglang_style:
                self.members = [0, 1]
            else:
                self.tp_src = 0

        def generate(self, prompts, params):
            text = "<rank a>" if len(prompts[0]) < 5 else "ok"
            ids = torch.tensor([tok.encode(text) + ([] if text.endswith(">") else [2])])
            return GenerationOutput(ids, torch.ones_like(ids), torch.zeros(ids.shape))

    tools = ToolRegistry([RankTool()])
    fmt = build_format("plain", tok, tools.schemas())
    got = []
    for style in (False, True):
        out = LoopEngine(TPEngine(style), fmt, tools, Budgets(64)).generate(
            [[5]], SamplingParams(64, eos_token_id=2))
        got.append(tok.decode(out.response_ids[0][out.response_mask[0].bool()]))
    return got


@pytest.mark.slow
def test_multi_turn_logprobs_masks_and_resume(tmp_path):
    import torch

    res = run_on_ranks(_rank, 2, str(tmp_path), timeout=600, preload=("megatron.core",))
    for r in res:
        assert r["inner"] == "BuiltinEngine"  # the weight sync saw the real engine
        assert r["shared"] == ["<rank a>\ntool: r0\nassistant: ok"] * 2, r["shared"]
        assert r["tool_tokens"] > 0 and r["model_tokens"] > 0, r  # tails with tool segments
        assert r["lp_gap"] < 1e-4, r["lp_gap"]
        assert r["record_equal"] and r["record_tool_tokens"] > 0, r["rec_stats"]
        ids, lmask, metrics = r["gathered"]  # generate: every rank gets the whole batch
        assert torch.equal(ids, res[0]["gathered"][0]) and torch.equal(lmask, res[0]["gathered"][1])
        assert metrics["multi_turn/turns/mean"] >= 1.0 and metrics == res[0]["gathered"][2]
        last = r["straight"][-1]
        assert last["multi_turn/turns/mean"] > 1.0  # some sequences had a second turn
        resumed = r["resumed"][-1]
        for key, value in last.items():
            if key.startswith(("timing_s/", "perf/", "reshard/", "rollout/handoff",
                               "checkpoint/")) or "tokens_per_s" in key or "_s" in key[-2:]:
                continue
            assert resumed[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        for name, w in r["straight_w"].items():
            torch.testing.assert_close(r["resumed_w"][name], w, rtol=0, atol=1e-6)


def _split_rank(rank, world, tmp):
    """Split 1 + 1: rank 1 generates (the agent loop runs there), rank 0 trains."""
    import warnings

    import torch

    from hybridrl.config import load_config
    from hybridrl.train import build_layout
    from hybridrl.trainer.ppo import PPOTrainer
    from hybridrl.trainer.split_run import fit_split

    warnings.filterwarnings("ignore")
    seen, real = {}, PPOTrainer._rollout

    def spy(self, prompts):
        rb = real(self, prompts)
        if "lp" not in seen:  # step 1: the engine's weights are the actor's
            seen.update(lp=self._logprobs(self.actor, rb), rb=rb)
        return rb

    PPOTrainer._rollout = spy
    try:
        with open(f"{tmp}/turn_hooks.py", "w") as f:  # one reward per assistant turn
            f.write("def one_each(turns, **kw):\n"
                    "    return [1.0 for t in turns if t['role'] == 'assistant']\n")
        cfg = load_config([CONFIG], _overrides(tmp, "split", 2, (
            "parallel.placement=split", "parallel.gen.world=1",
            f"rollout.multi_turn.turn_reward_fn={tmp}/turn_hooks.py:one_each")),
            world_size=world)
        train, _ = build_layout(cfg, world)
        torch.manual_seed(cfg.trainer.seed)
        hist = fit_split(cfg, train, 120, print_fn=lambda *a, **k: None)
    finally:
        PPOTrainer._rollout = real
    if rank == 1:
        return {"batches": hist}
    rb, lp = seen["rb"], seen["lp"]
    return {"hist": hist, "tool_tokens": int((rb.response_mask - rb.loss_mask).sum()),
            "model_tokens": int(rb.loss_mask.sum()),
            "lp_gap": float(((lp - rb.rollout_logprobs).abs() * rb.loss_mask).max())}


@pytest.mark.slow
def test_multi_turn_in_split_placement(tmp_path):
    """The generation rank runs the agent loop around its engine (rollout.split.server); the
    training rank reads the loss mask back from the received tails: tool segments are there,
    its log-probs equal the engine's on every model token, the multi-turn metrics come from the
    masks (was: refused in one line); a per-turn reward hook pays each assistant turn."""
    res = run_on_ranks(_split_rank, 2, str(tmp_path), timeout=600, preload=("megatron.core",))
    train, gen = res
    assert gen["batches"] == 2
    assert train["tool_tokens"] > 0 and train["model_tokens"] > 0, train
    assert train["lp_gap"] < 1e-4, train["lp_gap"]
    last = train["hist"][-1]
    assert last["multi_turn/turns/mean"] > 1.0 and "multi_turn/tool_errors" not in last
    # the per-turn hook (rollout.multi_turn.turn_reward_fn): 1 per assistant turn, so its mean
    # per sequence is the mean number of turns (one training rank: the same rows)
    for m in train["hist"]:
        assert m["multi_turn/turn_reward/mean"] == pytest.approx(m["multi_turn/turns/mean"])
