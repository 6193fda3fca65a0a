"""Batches of prompts in a seeded order with a resumable position.

Contract. ``PromptLoader(dataset, batch_size, shuffle, seed, drop_last)`` walks the dataset in
epochs. The order of epoch ``e`` is ``numpy.random.default_rng([seed, e]).permutation(n)`` when
``shuffle`` (else ``0..n-1``), so it depends only on (seed, epoch, n): two loaders with the same
arguments yield the same batches. ``next_batch()`` returns the next :class:`PromptBatch` and rolls
over to the next epoch by itself; ``iter(loader)`` yields the rest of the current epoch. With
``drop_last`` the tail of an epoch shorter than ``batch_size`` is skipped.

``state_dict()`` = {epoch, cursor, seed, shuffle, batch_size, drop_last, num_examples} describes the
position after the last batch handed out; ``load_state_dict`` on a loader over the same data makes
it hand out exactly the batches the saved one would have handed out next. A state saved with a
different seed, shuffle flag or dataset size is refused (ValueError naming the key).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from hybridrl.data.dataset import PromptBatch, PromptDataset, collate

_STATE_KEYS = ("epoch", "cursor", "seed", "shuffle", "batch_size", "drop_last", "num_examples")


class PromptLoader:
    """Seeded, resumable batches over a :class:`PromptDataset` (see module docstring)."""

    def __init__(
        self,
        dataset: PromptDataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if int(batch_size) < 1:
            raise ValueError(f"data.train_batch_size={batch_size}; allowed: >= 1")
        if drop_last and batch_size > len(dataset):
            raise ValueError(
                f"data.train_batch_size={batch_size} > {len(dataset)} prompts in the dataset "
                "with drop_last=True; allowed: a batch size <= the dataset size"
            )
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.cursor = 0
        self._order_cache: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        """Batches per epoch."""
        n, bs = len(self.dataset), self.batch_size
        return n // bs if self.drop_last else -(-n // bs)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Dataset indices in the order of ``epoch``."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            n = len(self.dataset)
            order = (
                np.random.default_rng([self.seed, epoch]).permutation(n)
                if self.shuffle
                else np.arange(n)
            )
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def next_indices(self) -> list[int]:
        """Dataset indices of the next batch; advances the position (and the epoch at its end)."""
        n = len(self.dataset)
        order = self.epoch_order(self.epoch)
        end = min(self.cursor + self.batch_size, n)
        indices = [int(i) for i in order[self.cursor : end]]
        self.cursor = end
        needed = self.batch_size if self.drop_last else 1
        if self.cursor + needed > n:
            self.epoch += 1
            self.cursor = 0
        return indices

    def next_batch(self) -> PromptBatch:
        indices = self.next_indices()
        return collate([self.dataset[i] for i in indices], self.dataset.pad_token_id)

    def __iter__(self) -> Iterator[PromptBatch]:
        epoch = self.epoch
        while self.epoch == epoch:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "num_examples": len(self.dataset),
        }

    def load_state_dict(self, state: dict) -> None:
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"loader state: missing keys {missing}; expected {list(_STATE_KEYS)}")
        mine = self.state_dict()
        for key in ("seed", "shuffle", "num_examples"):
            if state[key] != mine[key]:
                raise ValueError(
                    f"loader state: '{key}'={state[key]!r} differs from this loader's "
                    f"{mine[key]!r}; resuming needs the same data order"
                )
        cursor, n = int(state["cursor"]), len(self.dataset)
        if not 0 <= cursor < n or int(state["epoch"]) < 0:
            raise ValueError(
                f"loader state: epoch={state['epoch']} cursor={cursor}; allowed: epoch >= 0 "
                f"and 0 <= cursor < {n}"
            )
        self.epoch, self.cursor = int(state["epoch"]), cursor
        # A different batch size is allowed: the position counts prompts, not batches.
        needed = self.batch_size if self.drop_last else 1
        if self.cursor + needed > n:
            self.epoch, self.cursor = self.epoch + 1, 0
