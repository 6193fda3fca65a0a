"""Per-turn reward hook of multi-turn rollouts (hybridrl/rollout/multi_turn/turn_rewards.py):
the tail's turns decoded from the loss mask, one reward per assistant turn at that turn's last
token, bad results refused in one line naming the hook and the row."""

import pytest
import torch

from hybridrl.data.tokenizer import CharTokenizer
from hybridrl.rollout.batch import RolloutBatch
from hybridrl.rollout.multi_turn.turn_rewards import TurnRewards, turn_spans

HOOKS = '''
SEEN = []
def per_turn(turns, data_source, ground_truth, extra_info):
    SEEN.append([(t["role"], t["text"]) for t in turns])
    return [0.25 * (k + 1) for k in range(sum(t["role"] == "assistant" for t in turns))]
def last_only(turns, data_source, ground_truth, extra_info):
    return 2.0
def too_few(turns, data_source, ground_truth, extra_info):
    return [1.0]
def not_finite(turns, data_source, ground_truth, extra_info):
    return float("nan")
'''


def _batch(tok):
    segments = [[("m", "<calculator 1+2>"), ("t", "\ntool: 3\nassistant: "), ("m", "#### 3")],
                [("m", "#### 7")]]
    rows, losses = [], []
    for segs in segments:
        ids, loss = [], []
        for kind, text in segs:
            piece = tok.encode(text)
            ids += piece
            loss += [int(kind == "m")] * len(piece)
        rows.append(ids)
        losses.append(loss)
    R = max(map(len, rows)) + 2
    ids = torch.tensor([r + [0] * (R - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (R - len(r)) for r in rows])
    loss = torch.tensor([m + [0] * (R - len(m)) for m in losses])
    rb = RolloutBatch([[5], [6]], ids, mask, torch.zeros(ids.shape), [0, 1], ["3", "7"],
                      ["arithmetic"] * 2, [{}, {}], loss_mask=loss)
    return rb, [len(r) for r in rows]


def test_each_assistant_turn_gets_its_reward_at_its_last_token(tmp_path):
    (tmp_path / "hooks.py").write_text(HOOKS)
    tok = CharTokenizer()
    rb, lens = _batch(tok)
    spans = turn_spans(rb.loss_mask[0], rb.response_mask[0])
    assert [m for _, _, m in spans] == [True, False, True] and spans[-1][1] == lens[0]
    hook = TurnRewards(f"{tmp_path}/hooks.py:per_turn", tok)
    out = hook(rb)
    first_end = len(tok.encode("<calculator 1+2>")) - 1
    assert out[0, first_end] == 0.25 and out[0, lens[0] - 1] == 0.5 and out[0].sum() == 0.75
    assert out[1, lens[1] - 1] == 0.25 and out[1].sum() == 0.25
    seen = hook.fn.__globals__["SEEN"]
    assert seen[0] == [("assistant", "<calculator 1+2>"), ("tool", "\ntool: 3\nassistant: "),
                       ("assistant", "#### 3")]
    last = TurnRewards(f"{tmp_path}/hooks.py:last_only", tok)(rb)
    assert last[0, first_end] == 0.0 and last[0, lens[0] - 1] == 2.0


@pytest.mark.parametrize("name", ["too_few", "not_finite"])
def test_a_bad_result_is_one_line_naming_the_hook_and_row(tmp_path, name):
    (tmp_path / "hooks.py").write_text(HOOKS)
    tok = CharTokenizer()
    rb, _ = _batch(tok)
    with pytest.raises(ValueError, match=f"turn reward function '.*:{name}' returned .* row 0"):
        TurnRewards(f"{tmp_path}/hooks.py:{name}", tok)(rb)
    with pytest.raises(ValueError, match="no callable"):
        TurnRewards(f"{tmp_path}/hooks.py:missing", tok)
