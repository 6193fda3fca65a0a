"""Move a model's parameters, gradients or optimizer state to host memory and back, in place.

Contract:
- ``model_tensors(model, optimizer, part)`` lists the tensors of one ``part`` of a trained (or
  frozen) model on this rank: ``"params"`` (the parameters; megatron DDP's contiguous parameter
  buffers when the model has them), ``"grads"`` (DDP's fp32 ``main_grad`` buffers), ``"optim"``
  (the optimizer's Adam moments and its fp32 master copies that are not model memory).
- ``StorageOffloader`` works on the *storages* behind those tensors, so every view (a parameter
  inside a DDP buffer, a ``main_grad``, a distributed-optimizer shard) stays the same Python
  object and keeps working after the round trip:
  ``offload(tensors)`` copies each distinct storage to a host buffer (pinned when CUDA is
  available) and resizes the device storage to 0 bytes, releasing it (to the CUDA caching
  allocator on GPU); ``onload()`` resizes every storage back, copies the bytes in and drops the
  host buffers. The round trip is bit-exact. Calling ``offload`` on storages already offloaded
  (or ``onload`` with nothing offloaded) does nothing. On a CPU-only machine the same code runs
  with an ordinary host buffer as the stand-in for pinned memory, so tests exercise it.
  ``offload(tensors, keep=False)`` drops the bytes instead (nothing is copied: gradients that
  the next update zeroes before reading); ``onload`` gives such storages back zero-filled.
  ``offload`` and ``onload`` return the bytes copied across (0 for dropped storages);
  ``last_freed`` is the device bytes the last ``offload`` released. After freeing, the CUDA
  caching allocator's unused blocks go back to the driver (``torch.cuda.empty_cache()`` when
  CUDA is available), so another process (SGLang's) can map them.
- ``resident_bytes(tensors)`` is the number of bytes their distinct storages hold right now.
"""

from __future__ import annotations

import torch

PARTS = ("params", "grads", "optim")


def _ddp_buffers(model) -> list:
    ddp = getattr(model, "ddp", None)
    return list(getattr(ddp, "buffers", []) or []) if ddp is not None else []


def model_tensors(model, optimizer, part: str) -> list[torch.Tensor]:
    """The tensors of ``part`` (see the module docstring); [] when the model has none."""
    if part not in PARTS:
        raise ValueError(f"offload part must be one of {PARTS}, got {part!r}")
    buffers = _ddp_buffers(model)
    if part == "params":
        held = [b.param_data for b in buffers if b.param_data is not None]
        return held + [p for p in model.module.parameters()]  # views of held storages dedupe
    if part == "grads":
        return [b.grad_data for b in buffers if b.grad_data is not None]
    if optimizer is None:
        return []
    model_storages = {_key(t) for t in model_tensors(model, optimizer, "params")}
    out = [t for part_opt in optimizer._parts for st in part_opt.optimizer.state.values()
           for key, t in st.items() if key != "step" and torch.is_tensor(t)]
    return out + [p for p in optimizer.main_params() if _key(p) not in model_storages]


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.untyped_storage().nbytes() else id(
        t.untyped_storage())


def _distinct_storages(tensors) -> list:
    seen, out = set(), []
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and _key(t) not in seen:
            seen.add(_key(t))
            out.append(storage)
    return out


def resident_bytes(tensors) -> int:
    """Bytes held right now by the distinct storages behind ``tensors``."""
    return sum(s.nbytes() for s in _distinct_storages(tensors))


def _as_bytes(storage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class StorageOffloader:
    """Host copies of offloaded storages (see the module docstring)."""

    def __init__(self):
        # (device storage, its bytes, host copy or None when dropped)
        self._held: list[tuple[object, int, torch.Tensor | None]] = []
        self.last_freed = 0

    @property
    def offloaded_bytes(self) -> int:
        return sum(nbytes for _, nbytes, _ in self._held)

    @torch.no_grad()
    def offload(self, tensors, keep: bool = True) -> int:
        """Free the storages behind ``tensors``, copying them to host memory first when
        ``keep``; returns the bytes copied (``last_freed``: the device bytes released)."""
        pin = torch.cuda.is_available()
        copied = freed = 0
        for storage in _distinct_storages(tensors):  # already-offloaded ones have 0 bytes
            host = None
            if keep:
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.copy_(_as_bytes(storage), non_blocking=pin)
                copied += storage.nbytes()
            self._held.append((storage, storage.nbytes(), host))
            freed += storage.nbytes()
        if pin and copied:
            torch.cuda.current_stream().synchronize()  # the copies finish before the frees
        for storage, _, _ in self._held:
            storage.resize_(0)
        if pin and freed:  # the freed blocks leave the caching allocator: SGLang can map them
            torch.cuda.empty_cache()
        self.last_freed = freed
        return copied

    @torch.no_grad()
    def onload(self) -> int:
        """Bring every offloaded storage back (bit-exact; dropped ones zero-filled); returns
        the bytes copied in."""
        copied = 0
        for storage, nbytes, host in self._held:
            storage.resize_(nbytes)
            if host is None:
                _as_bytes(storage).zero_()
            else:
                _as_bytes(storage).copy_(host, non_blocking=host.is_pinned())
                copied += nbytes
        self._held = []
        return copied
