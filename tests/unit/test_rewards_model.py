"""Reward-model scorer: value at the last response token, against a per-row Python loop."""

import pytest
import torch

from hybridrl.rewards import RewardModelScorer, place_on_last_token


class TinyCritic(torch.nn.Module):
    """A critic-shaped model: token embedding -> linear head, values [B, T, 1]."""

    def __init__(self, vocab=11, hidden=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids) * attention_mask.unsqueeze(-1)
        return self.head(torch.cumsum(h, dim=1))  # [B, T, 1], depends on the whole prefix


def test_hand_case_reads_last_response_value():
    values = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0, 9.0]])
    scorer = RewardModelScorer(lambda ids, mask: values)
    ids = torch.zeros(2, 5, dtype=torch.long)
    # response = last 3 positions; row 0 has 2 response tokens (positions 2, 3), row 1 has none
    response_mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert scorer(ids, torch.ones_like(ids), response_mask).tolist() == [3.0, 0.0]
    tokens = place_on_last_token(torch.tensor([0.5, 7.0]), response_mask)
    assert tokens.tolist() == [[0.0, 0.5, 0.0], [0.0, 0.0, 0.0]]


def test_random_batches_against_loop():
    torch.manual_seed(0)
    model = TinyCritic()
    scorer = RewardModelScorer(model)
    for _ in range(5):
        bsz, prompt_len, resp_len = 4, 6, 7
        ids = torch.randint(0, 11, (bsz, prompt_len + resp_len))
        attn = torch.ones_like(ids)
        lengths = torch.randint(0, resp_len + 1, (bsz,))
        resp_mask = (torch.arange(resp_len)[None, :] < lengths[:, None]).long()  # right-padded
        attn[:, prompt_len:] = resp_mask
        scores = scorer(ids, attn, resp_mask)
        full = torch.cat([torch.zeros(bsz, prompt_len, dtype=torch.long), resp_mask], dim=1)
        assert torch.equal(scorer(ids, attn, full), scores)  # [B, T] mask form agrees
        with torch.no_grad():
            values = model(ids, attn).squeeze(-1)
        for b in range(bsz):
            n = int(lengths[b])
            want = values[b, prompt_len + n - 1].item() if n else 0.0
            assert scores[b].item() == pytest.approx(want, abs=1e-6)
        assert not scores.requires_grad


def test_shape_errors():
    scorer = RewardModelScorer(lambda ids, mask: torch.zeros(ids.shape[0], 3))
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="returned values"):
        scorer(ids, torch.ones_like(ids), torch.ones(2, 2))
    with pytest.raises(ValueError, match="response_mask"):
        scorer(ids, torch.ones_like(ids), torch.ones(2, 6))
