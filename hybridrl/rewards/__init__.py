"""Rewards: rule functions keyed by data_source, user functions, reward models, penalties.

Contract: see each module. ``RewardScorer`` (scoring) scores a batch of decoded responses and
returns per-sequence scores + metrics; ``RewardModelScorer`` (reward_model) scores token batches
with a critic-architecture model; ``REWARD_FNS`` is the registry users extend.
"""

from hybridrl.registry import Registry
from hybridrl.rewards.custom import load_reward_fn
from hybridrl.rewards.reward_model import RewardModelScorer, place_on_last_token
from hybridrl.rewards.scoring import REWARD_FNS, RewardScorer, build_reward_scorer

__all__ = [
    "REWARD_FNS",
    "Registry",
    "RewardModelScorer",
    "RewardScorer",
    "build_reward_scorer",
    "load_reward_fn",
    "place_on_last_token",
]
