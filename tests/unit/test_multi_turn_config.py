"""rollout.multi_turn: its knobs are checked with one line, verl's multi-turn keys translate where
they mean the same and are refused with one line where not; a split placement's worker derives the mask of its tails."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from hybridrl.config.loader import load_config

DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "demo_tools.yaml")
MT = "actor_rollout_ref.rollout.multi_turn"


def test_verl_multi_turn_keys_translate():
    cfg = load_config([DEMO], [f"{MT}.enable=false", f"{MT}.format=hermes",
                               f"{MT}.max_assistant_turns=7", f"{MT}.max_tool_response_length=99",
                               f"{MT}.tool_response_truncate_side=right"], world_size=2)
    mt = cfg.rollout.multi_turn
    assert (mt.enable, mt.format, mt.max_assistant_turns, mt.max_tool_response_chars) == (
        False, "hermes", 7, 99)


@pytest.mark.parametrize("override,words", [
    (f"{MT}.tool_config_path=tools.yaml", "list hybridrl tools in rollout.multi_turn.tools"),
    (f"{MT}.max_user_turns=2", "no simulated user turns"),
    (f"{MT}.max_parallel_calls=2", "threads per round, another meaning"),
    (f"{MT}.interaction_config_path=i.yaml", "no interaction agents"),
    (f"{MT}.tool_response_truncate_side=middle", "cut at its end"),
    (f"{MT}.format=chatml", "rollout.multi_turn.format must be one of"),
    ("rollout.multi_turn.max_assistant_turns=0", "max_assistant_turns must be > 0"),
    ("rollout.multi_turn.max_tool_response_chars=0", "max_tool_response_chars must be > 0"),
])
def test_bad_multi_turn_settings_are_one_line(override, words):
    with pytest.raises(ValueError, match=words) as err:
        load_config([DEMO], [override], world_size=2)
    assert "\n" not in str(err.value)


def test_a_split_worker_derives_the_mask_and_counts_the_tails():
    """Split placement: the training ranks hold no engine (the generation ranks run the loop,
    rollout.split.server); the wrapper only reads each received tail's loss mask back from its
    ids and counts turns, tool calls and tokens from the masks (was: refused in one line)."""
    import torch

    from hybridrl.data.tokenizer import CharTokenizer
    from hybridrl.rollout.base import GenerationOutput
    from hybridrl.rollout.multi_turn import MultiTurnWorker, build_multi_turn
    from hybridrl.rollout.multi_turn.wrap import mask_stats

    tok = CharTokenizer()
    cfg = load_config([DEMO], [], world_size=2)
    tails = ["<calculator 1+2>\ntool: 3\nassistant: #### 3", "#### 7"]
    ids = [tok.encode(t) + [tok.eos_token_id] for t in tails]
    width = max(map(len, ids))
    ids_NR = torch.tensor([i + [0] * (width - len(i)) for i in ids])
    mask_NR = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])

    class _Remote:  # the split placement's worker: no engine on the training ranks
        engine, device = None, "cpu"
        groups = types.SimpleNamespace(tp_rank=0, pp_rank=0)

        def generate_partitioned(self, prompts, params, seed, plan_parts):
            return [0, 1], GenerationOutput(ids_NR, mask_NR, torch.zeros(ids_NR.shape)), None

    worker = build_multi_turn(cfg, tok, _Remote())
    assert isinstance(worker, MultiTurnWorker)
    _, out, _ = worker.generate_partitioned([[5], [6]], None, 0, None)
    model = tok.encode("<calculator 1+2>") + tok.encode("#### 3") + [tok.eos_token_id]
    assert int(out.loss_mask[0].sum()) == len(model)  # the tool's output and template: 0
    assert out.loss_mask[1].tolist() == mask_NR[1].tolist()  # no call: every token the model's
    stats = mask_stats(out.loss_mask, mask_NR)
    assert (stats["turns"], stats["tool_calls"], stats["with_calls"]) == (3, 1, 1)
    m = worker.pop_metrics()
    assert m["multi_turn/turns/mean"] == 1.5 and m["multi_turn/tool_calls/rate"] == 0.5
    assert "multi_turn/tool_errors" not in m  # the loop's own record stays on the gen ranks
    off = load_config([DEMO], ["rollout.multi_turn.enable=false"], world_size=2)
    plain = _Remote()
    assert build_multi_turn(off, None, plain) is plain


def test_a_worker_is_wrapped_once():
    from hybridrl.data.tokenizer import CharTokenizer
    from hybridrl.rollout.multi_turn import MultiTurnWorker, build_multi_turn

    class _Local:
        engine = object()

    cfg = load_config([DEMO], [], world_size=2)
    once = build_multi_turn(cfg, CharTokenizer(), _Local())
    assert isinstance(once, MultiTurnWorker) and build_multi_turn(cfg, CharTokenizer(), once) is once
