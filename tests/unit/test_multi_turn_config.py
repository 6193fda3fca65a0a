"""rollout.multi_turn: its knobs are checked with one line, verl's multi-turn keys translate where
they mean the same and are refused with one line where not, a split placement is refused."""

from __future__ import annotations

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


def test_split_placement_is_refused_with_one_line():
    from hybridrl.rollout.multi_turn import build_multi_turn

    class _Remote:  # the split placement's worker: no engine on the training ranks
        engine = None

    cfg = load_config([DEMO], [], world_size=2)
    with pytest.raises(ValueError, match="parallel.placement=split is not supported"):
        build_multi_turn(cfg, None, _Remote())
    off = load_config([DEMO], ["rollout.multi_turn.enable=false"], world_size=2)
    worker = _Remote()
    assert build_multi_turn(off, None, worker) is worker


def test_a_worker_is_wrapped_once():
    from hybridrl.data.tokenizer import CharTokenizer
    from hybridrl.rollout.multi_turn import MultiTurnWorker, build_multi_turn

    class _Local:
        engine = object()

    cfg = load_config([DEMO], [], world_size=2)
    once = build_multi_turn(cfg, CharTokenizer(), _Local())
    assert isinstance(once, MultiTurnWorker) and build_multi_turn(cfg, CharTokenizer(), once) is once
