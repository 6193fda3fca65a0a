"""hybridrl.trainer.on_policy: when the old-log-prob forward may be skipped (pure)."""

from types import SimpleNamespace as NS

import pytest
import torch

from hybridrl.trainer.on_policy import old_or_current, skip_old_forward


def _cfg(epochs=1, mini=12, batch=12, kl_in_reward=False, max_kl=0.0):
    return NS(actor=NS(ppo_epochs=epochs, ppo_mini_batch_size=mini),
              data=NS(train_batch_size=batch), algorithm=NS(use_kl_in_reward=kl_in_reward),
              trainer=NS(kl_guard=NS(max_kl=max_kl)))


@pytest.mark.parametrize("changes, skip", [
    ({}, True),
    ({"mini": 24}, True),  # a mini-batch larger than the batch is still one optimizer step
    ({"epochs": 2}, False),  # the second epoch's old log-probs are not the current ones
    ({"mini": 6}, False),  # the second mini-batch runs on updated weights
    ({"kl_in_reward": True}, False),  # in-reward KL reads them before the update
    ({"max_kl": 2.0}, False),  # the KL guard compares them with the post-update ones
])
def test_skip_only_when_exactly_on_policy(changes, skip):
    assert skip_old_forward(_cfg(**changes)) is skip


def test_old_or_current_detaches_the_current_log_probs():
    cur = torch.randn(3, 4, requires_grad=True)
    old = old_or_current(None, cur)
    assert torch.equal(old, cur) and not old.requires_grad
    ratio = torch.exp(cur - old)
    assert torch.equal(ratio, torch.ones(3, 4))
    (ratio * 2.0).sum().backward()  # d/dlogp of A * ratio at ratio 1 is A, as with a separate forward
    assert torch.equal(cur.grad, torch.full((3, 4), 2.0))
    given = torch.zeros(3, 4)
    assert old_or_current(given, cur) is given
