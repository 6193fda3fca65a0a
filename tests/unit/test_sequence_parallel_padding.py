"""Sequence parallelism needs T divisible by tp (megatron's sequence-parallel embedding scatters
the sequence over the TP ranks): ``pad_to_multiple`` right-pads exactly the per-position tensors
of a micro-batch, PPO's (from ``RolloutBatch.microbatch``) and SFT's (``sft_microbatch``)."""

import torch

from hybridrl.models.forward import pad_to_multiple
from hybridrl.rollout.batch import RolloutBatch


def test_ppo_microbatch_is_padded_to_a_multiple_of_tp_and_nothing_else_moves():
    rb = RolloutBatch([[5, 6, 7], [8]], torch.tensor([[1, 2, 0], [3, 4, 9]]),
                      torch.tensor([[1, 1, 0], [1, 1, 1]]), torch.zeros(2, 3), [0, 1],
                      [None, None], ["x", "x"], [{}, {}])
    mb = rb.microbatch([0, 1])
    assert mb["input_ids"].shape == (2, 5)
    for tp in (2, 4, 8):
        out = pad_to_multiple(mb, tp)
        t = out["input_ids"].shape[1]
        assert t % tp == 0 and t - 5 < tp
        assert torch.equal(out["input_ids"][:, :5], mb["input_ids"])
        assert not out["input_ids"][:, 5:].any()
        assert out["resp_index"] is mb["resp_index"]  # [b, R]: not a sequence tensor
        assert out["response_mask"] is mb["response_mask"]
    assert pad_to_multiple(mb, 5) is mb  # already a multiple: untouched


def test_sft_microbatch_pads_labels_and_loss_mask_with_zeros():
    batch = {"input_ids": torch.ones(3, 7, dtype=torch.long),
             "labels": torch.ones(3, 7, dtype=torch.long), "loss_mask": torch.ones(3, 7)}
    out = pad_to_multiple(batch, 2)
    assert all(out[k].shape == (3, 8) for k in batch)
    assert float(out["loss_mask"].sum()) == 21.0 and int(out["labels"][:, 7].sum()) == 0
