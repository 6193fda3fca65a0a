"""hybridrl.models.offload on plain tensors: storages are freed and restored bit-exactly, and
views into them (as DDP's parameters are views of its buffers) keep working."""

import torch

from hybridrl.models.offload import StorageOffloader, resident_bytes


def test_round_trip_frees_and_restores_views_bit_exact():
    g = torch.Generator().manual_seed(0)
    buffer = torch.randn(1000, generator=g)
    views = [buffer[:300].view(10, 30), buffer[300:]]  # two "parameters" in one buffer
    other = torch.randn(7, 5, generator=g, dtype=torch.float64)
    before = [v.clone() for v in views] + [other.clone()]
    mover = StorageOffloader()
    assert resident_bytes(views + [other]) == 1000 * 4 + 35 * 8  # one storage per buffer
    assert mover.offload(views + [other]) == 1000 * 4 + 35 * 8
    assert resident_bytes(views + [other]) == 0 and buffer.untyped_storage().nbytes() == 0
    assert mover.offload(views) == 0  # already away: nothing moves twice
    assert mover.onload() == 1000 * 4 + 35 * 8
    after = [v.clone() for v in views] + [other.clone()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    views[0].add_(1.0)  # the views still alias the buffer
    assert torch.equal(buffer[:300], before[0].flatten() + 1.0)
    assert mover.onload() == 0


def test_dropped_storages_are_freed_without_a_copy_and_come_back_zeroed():
    """Gradients the next update zeroes: keep=False copies nothing either way."""
    grads = torch.randn(500)
    views = [grads[:200], grads[200:]]
    mover = StorageOffloader()
    assert mover.offload(views, keep=False) == 0 and mover.last_freed == 500 * 4
    assert resident_bytes(views) == 0 and mover.offloaded_bytes == 500 * 4
    assert mover.onload() == 0
    assert grads.untyped_storage().nbytes() == 500 * 4 and torch.count_nonzero(grads) == 0
    views[1].add_(2.0)  # the views alias the restored storage
    assert float(grads[300]) == 2.0
