"""What a Python caller hands ``PPOTrainer`` besides the config: prompts, rewards, an estimator.

Contract (each function is called by ``PPOTrainer.__init__``, on every rank):
- ``with_estimator(cfg, adv_estimator)``: ``adv_estimator`` None or a registered name (str)
  gives ``cfg`` with ``algorithm.adv_estimator`` set to it (None: unchanged); a callable with the
  estimator signature (``hybridrl.algos.advantages``) is used under the name it is registered
  with, else registered (override) as ``python:<module>.<qualname>``, and that name goes into
  the config: a run's saved config names it and a resume must pass the same callable. A name
  that is not registered is a one-line ``ValueError`` listing the registered ones.
- ``reward_scorer(cfg, reward_fn)``: the ``RewardScorer`` of the ``reward`` section, with
  ``reward_fn`` a callable (verl's signature ``fn(data_source, solution_str, ground_truth,
  extra_info) -> float | {"score": ...}``) scoring every row, or a mapping data_source ->
  callable consulted before ``REWARD_FNS``. Refused in one line: ``reward_fn`` together with
  ``reward.reward_fn`` or ``reward.reward_model_path``, and with ``reward.num_workers`` > 0 (the
  pool's processes rebuild the scorer from the config and would not see the callables).
- ``agree(problem, digest=None)``: the ranks' agreement both use (and ``hybridrl.trainer.entry``).
- ``build_data(cfg, tokenizer, train_data, val_data, reward_fn)``: the (train, validation)
  ``PromptLoader`` s. Without ``train_data``/``val_data`` exactly ``hybridrl.data.build.build_loaders``
  of the config (parquet files or the synthetic task). With them (any container of
  ``hybridrl.data.records.rows_from_records``), the rows are checked (fields; data_sources that
  no reward function covers; empty prompts: ``hybridrl.trainer.startup.row_problems``),
  tokenized and loaded exactly as parquet rows are, and then the ranks agree (one
  ``all_gather_object`` on the default group, when one is initialized): a problem on any rank,
  or ranks holding different prompts (``PromptDataset.digest``), raises the same one-line
  ``ValueError`` on every rank, so no rank trains on other prompts than its peers and none
  waits. Every rank holds the whole dataset and draws the same batches (each generation
  replica then samples its share, and each DP rank trains only on its rows:
  ``hybridrl.rollout.partition``), as with parquet files.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from hybridrl.algos.advantages import ADVANTAGE_ESTIMATORS
from hybridrl.data.build import build_loaders
from hybridrl.data.loader import PromptLoader
from hybridrl.data.records import rows_from_records
from hybridrl.registry import Registry
from hybridrl.rewards.custom import check_call
from hybridrl.rewards.scoring import REWARD_FNS, RewardScorer, build_reward_scorer
from hybridrl.trainer.startup import known_sources, row_problems


def with_estimator(cfg, adv_estimator: str | Callable | None):
    """``cfg`` with ``algorithm.adv_estimator`` naming ``adv_estimator`` (module docstring)."""
    if adv_estimator is None:
        return cfg
    if isinstance(adv_estimator, str):
        name = adv_estimator
        if name not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"adv_estimator {name!r} is not a registered advantage estimator; "
                             f"registered: {ADVANTAGE_ESTIMATORS.names()}")
    elif callable(adv_estimator):
        same = [n for n in ADVANTAGE_ESTIMATORS.names()
                if ADVANTAGE_ESTIMATORS.get(n) is adv_estimator]
        qualname = getattr(adv_estimator, "__qualname__", type(adv_estimator).__name__)
        name = same[0] if same else f"python:{adv_estimator.__module__}.{qualname}"
        if not same:
            ADVANTAGE_ESTIMATORS.register(name, adv_estimator, override=True)
    else:
        raise ValueError(f"adv_estimator must be a registered name or a callable; got "
                         f"{type(adv_estimator).__name__}")
    return replace(cfg, algorithm=replace(cfg.algorithm, adv_estimator=name))


def _reward_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


def reward_scorer(cfg, reward_fn: Callable | Mapping[str, Callable] | None) -> RewardScorer:
    """The run's scorer, with ``reward_fn`` when given (see the module docstring)."""
    if reward_fn is None:
        return build_reward_scorer(cfg.reward)
    r = cfg.reward
    if r.reward_fn or r.reward_model_path:
        key = "reward.reward_fn" if r.reward_fn else "reward.reward_model_path"
        raise ValueError(f"reward_fn is given and {key} is set; give one scorer")
    if r.num_workers:
        raise ValueError(f"reward_fn callables score in the rank's own process; "
                         f"reward.num_workers={r.num_workers} must be 0 (a pool's processes "
                         "rebuild the scorer from the config: use reward.reward_fn there)")
    scorer = build_reward_scorer(r)
    if isinstance(reward_fn, Mapping):
        registry = Registry(REWARD_FNS.kind)
        for name in REWARD_FNS.names():
            registry.register(name, REWARD_FNS.get(name))
        for source, fn in reward_fn.items():
            registry.register(source, fn, override=True)  # TypeError: not callable, named
            check_call(fn, _reward_name(fn), {})
        scorer.registry = registry
    elif callable(reward_fn):
        check_call(reward_fn, _reward_name(reward_fn), {})
        scorer.custom_fn, scorer.custom_name = reward_fn, _reward_name(reward_fn)
    else:
        raise ValueError(f"reward_fn must be a callable or a mapping data_source -> callable; "
                         f"got {type(reward_fn).__name__}")
    return scorer


def agree(problem: str | None, digest: str | None = None) -> None:
    """Every rank raises the first rank's problem (its text when every rank has the same one,
    else prefixed with its rank), or the first disagreement on ``digest`` (the prompts)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if problem:
            raise ValueError(problem)
        return
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (problem, digest))
    bad = [(r, p) for r, (p, _) in enumerate(seen) if p]
    if bad:
        shared = all(p == bad[0][1] for p, _ in seen)
        raise ValueError(bad[0][1] if shared else f"rank {bad[0][0]}: {bad[0][1]}")
    differ = [r for r, (_, d) in enumerate(seen) if d != seen[0][1]]
    if differ:
        raise ValueError(f"ranks hold different prompts: rank {differ[0]}'s train_data/val_data "
                         "differ from rank 0's; pass the same rows, in the same order, on every "
                         "rank")


def build_data(cfg, tokenizer, train_data: Any = None, val_data: Any = None,
               reward_fn: Callable | Mapping[str, Callable] | None = None,
               ) -> tuple[PromptLoader, PromptLoader | None]:
    """(train loader, validation loader or None); see the module docstring."""
    if train_data is None and val_data is None:
        return build_loaders(cfg.data, tokenizer)
    problem, digest, loaders = None, None, None
    try:
        key, known = cfg.data.prompt_key, known_sources(cfg, reward_fn)
        rows = {name: None if data is None else rows_from_records(data, prompt_key=key, name=name)
                for name, data in (("train_data", train_data), ("val_data", val_data))}
        problems = [p for name, r in rows.items() if r is not None
                    for p in row_problems(r, name, known)]
        if problems:
            raise ValueError(problems[0])
        loaders = build_loaders(cfg.data, tokenizer, rows["train_data"], rows["val_data"])
        digest = "/".join(loader.dataset.digest() for loader in loaders if loader is not None)
    except ValueError as err:
        problem = str(err).strip().splitlines()[0]
    agree(problem, digest)
    return loaders
