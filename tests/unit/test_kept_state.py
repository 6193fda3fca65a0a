"""A checkpoint's in-flight batch (split placement, ``rollout.async_steps``) is stored in the
hand-off's wire form: ``kept_payload`` -> ``kept_output`` gives back the padded batch exactly,
at 8 bytes per real token instead of 20 per padded position; the padded form of earlier
checkpoints still loads."""

from __future__ import annotations

import io

import torch

from hybridrl.rollout.base import GenerationOutput
from hybridrl.rollout.split.remote import kept_output, kept_payload

PAD = 7


def _batch(lens, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lens), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    logp = torch.zeros(len(lens), width)
    for i, n in enumerate(lens):
        ids[i, :n] = torch.randint(0, 50000, (n,), generator=g)
        mask[i, :n] = 1
        logp[i, :n] = -torch.rand(n, generator=g) * 5
    return GenerationOutput(ids, mask, logp)


def _saved_bytes(obj) -> int:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.tell()


def test_wire_form_round_trip_is_exact_and_small():
    lens = [1, 0, 40, 3, 64, 17, 9, 2]
    out = _batch(lens, 64)
    state = kept_payload(out)
    back = kept_output(state, PAD)
    assert torch.equal(back.response_ids, out.response_ids)
    assert torch.equal(back.response_mask, out.response_mask)
    assert torch.equal(back.logprobs, out.logprobs)  # the fp32 bits travel as they are
    padded = {"ids": out.response_ids, "mask": out.response_mask, "logprobs": out.logprobs}
    real = sum(lens)
    assert state["rows"].numel() * 4 == 8 * real  # int32 id + fp32 log-prob per real token
    assert _saved_bytes(state) < _saved_bytes(padded) / 3


def test_padded_form_of_earlier_checkpoints_loads():
    out = _batch([5, 2, 0], 6, seed=1)
    back = kept_output({"ids": out.response_ids, "mask": out.response_mask,
                        "logprobs": out.logprobs}, PAD)
    assert torch.equal(back.response_ids, out.response_ids)
    assert torch.equal(back.logprobs, out.logprobs)
