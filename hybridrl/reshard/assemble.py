"""Assemble received rows into the rank's generation shard and hand them to a format/sink.

Contract:
- ``Assembler(plan, rank, fmt, sink=None)`` receives canonical row pieces (``accept``), keeps one
  buffer per destination interval (``plan.dests[rank]``), and as soon as a parameter's interval is
  complete it cuts this rank's gen piece out of it, converts it with ``fmt(spec, piece)`` (a pure
  local permutation returning ``[(name, tensor)]``, see hybridrl.reshard.formats) and frees the
  buffer. ``flush()`` (called by the executor after every bucket) passes the newly converted
  tensors to ``sink`` (e.g. an engine's weight loader); without a sink they are kept and
  returned by ``result()``. ``sink_every_flush=True`` calls the sink at every flush, with an
  empty list when nothing completed (a sink that runs one collective round per reshard phase
  needs every call; the SGLang push does).
- ``into`` (optional): this rank's existing gen-layout megatron tensors by stage-local name (e.g.
  a gen model's parameters). Received rows then land directly in them (their canonical views),
  padding rows are zeroed (unless ``zero_padding=False``: a consumer that never reads them,
  whose targets may be someone else's tensors), and the emitted tensors ARE those tensors: no
  allocation, no copy,
  ``fmt`` unused. Needs a plan whose destination is the gen shard (zero_redundancy, p2p).
  A target may also be a list of K tensors: the gen shard kept in K parts, part k stored as
  megatron stores TP rank k of the gen rank's K sub-ranks at TP size gen tp·K (vocab chunk /
  K rows), i.e. consecutive row segments of the canonical gen piece (the builtin engine's
  ``blocks``); a received piece lands in the part holding its rows (straight in, when it is
  the whole part or another contiguous slice of it).
  Every target (name, shape, dtype) and the strategy are checked at construction; a problem is
  not raised there but kept in ``into_error``, which ``run_plan`` reports through its plan check
  so all ranks raise together before any transfer (a lazy check would raise mid-exchange on one
  rank and leave its peers blocked).
- Gen pieces with no real rows (vocab chunks past the vocabulary) are emitted at construction.
- ``slot(key, lo, hi)`` gives the executor a contiguous view to receive into (no extra copy);
  ``spare`` (optional, from the targets' owner): how many elements right after such a view are
  scratch a merged message may overwrite (``hybridrl.reshard.coalesce``).
- ``dtype`` / ``device``: of the buffers it allocates (must match the training tensors; NCCL:
  the CUDA device, which is also where an engine reading the emitted tensors through CUDA IPC
  needs them). The default stays the CPU.
- ``live_bytes``: canonical bytes of open buffers plus converted tensors kept (no sink) or
  waiting for the next flush (sink; with ``into`` neither counts: those are the targets).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridrl.reshard.planner import Plan
from hybridrl.reshard.specs import ParamSpec, canonical_view, storage_shape

Format = Callable[[ParamSpec, torch.Tensor], list[tuple[str, torch.Tensor]]]
Sink = Callable[[list[tuple[str, torch.Tensor]]], None]


class Assembler:
    """Receives canonical rows, completes this rank's gen shard parameter by parameter and
    hands each to ``fmt`` / ``sink``, or receives in place into ``into`` (module doc).

    ``plan``/``rank``: the plan and the rank it assembles for (a rank outside the plan is
    reported by ``run_plan``'s agreement, not raised here); ``fmt``: a format of
    ``hybridrl.reshard.formats`` (unused with ``into``); ``sink``: called at each flush with
    the converted ``[(name, tensor)]`` (None: kept for ``result()``); ``dtype``/``device``: of
    the buffers it allocates (the training tensors' dtype); ``into``, ``zero_padding``,
    ``sink_every_flush``, ``spare``: see the module doc."""

    def __init__(self, plan: Plan, rank: int, fmt: Format | None, sink: Sink | None = None,
                 dtype: torch.dtype = torch.float32, into: dict[str, torch.Tensor] | None = None,
                 device: torch.device | str = "cpu", sink_every_flush: bool = False,
                 zero_padding: bool = True, spare: Callable | None = None):
        self.plan, self.rank, self.fmt, self.sink, self.dtype = plan, rank, fmt, sink, dtype
        self.zero_padding = zero_padding
        self.sink_every_flush = sink_every_flush
        self.device = torch.device(device)
        self.into = into
        self.pending, self.regions, self.copies, self.kept = [], {}, None, {}
        self.open_bytes = self.kept_bytes = self.pending_bytes = 0
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < plan.gen.world:
            # not raised here (the other ranks would wait in run_plan's agreement): reported
            # through it, like a wrong ``into=`` target
            self.into, self.dests = None, {}
            self.into_error = f"rank {rank!r} is outside the plan's {plan.gen.world} ranks"
            return
        self.spare = spare  # view -> elements of scratch after it (merged messages' holes)
        self.copies: list | None = None  # (target, source) row copies made, while recording
        self.dests = plan.dests[rank]
        self.gen_specs: dict[str, list[ParamSpec]] = {}
        self.regions: dict[str, list] = {}  # key -> [buffer, rows filled]
        self.pending: list[tuple[str, torch.Tensor]] = []
        self.kept: dict[str, torch.Tensor] = {}
        self.into_error = None if into is None else self._into_problem()
        for spec in plan.specs:
            iv = plan.gen.interval(spec, rank)
            if iv is None:
                continue
            if iv[1] > iv[0]:
                self.gen_specs.setdefault(spec.key, []).append(spec)
            elif self.into_error is None:  # nothing real to receive: all padding
                self._emit(spec, torch.empty(spec.piece_shape(0), dtype=dtype, device=self.device))
        missing = set(self.gen_specs) - set(self.dests)
        if missing:
            raise AssertionError(f"plan gives rank {rank} no destination for {sorted(missing)}")

    @property
    def live_bytes(self) -> int:
        """Canonical bytes of open buffers plus converted tensors kept or awaiting a flush."""
        return self.open_bytes + self.kept_bytes + self.pending_bytes

    def _into_problem(self) -> str | None:
        """Why ``into`` cannot receive this rank's gen shard (first problem), or None."""
        if self.plan.strategy in ("allgather", "vanilla"):
            return (f"into= needs a gen-shard destination; strategy {self.plan.strategy!r} "
                    "assembles full tensors")
        gen = self.plan.gen
        for spec in self.plan.specs:
            if gen.interval(spec, self.rank) is None:
                continue
            name = spec.local_name(gen.pp, gen.num_layers)
            want = storage_shape(spec, gen.tp, gen.vocab_chunk)
            if name not in self.into:
                return f"rank {self.rank}: into[{name!r}] is missing (expected shape {want})"
            parts = self.into[name]
            if isinstance(parts, (list, tuple)):
                k = len(parts)
                if k < 1 or (gen.vocab_chunk % k if spec.kind == "vocab"
                             else spec.rows % (gen.tp * k)):
                    return f"rank {self.rank}: into[{name!r}]: cannot be kept in {k} parts"
                want = storage_shape(spec, gen.tp * k, gen.vocab_chunk // k)
            else:
                parts = [parts]
            for got in parts:
                if tuple(got.shape) != want:
                    return (f"rank {self.rank}: into[{name!r}]: expected shape {want}, "
                            f"got {tuple(got.shape)}")
                if got.dtype != self.dtype:
                    return (f"rank {self.rank}: into[{name!r}]: expected dtype {self.dtype}, "
                            f"got {got.dtype}")
        return None

    def _target(self, spec: ParamSpec):
        """(name, existing tensor or list of parts) of ``into`` for a gen spec."""
        gen = self.plan.gen
        name = spec.local_name(gen.pp, gen.num_layers)
        if name not in self.into:
            raise ValueError(f"into[{name!r}] is missing")
        return name, self.into[name]

    def _segments(self, spec: ParamSpec, lo: int, hi: int) -> list:
        """[(first row, end row, canonical view)] of the target parts holding rows [lo, hi)."""
        target = self._target(spec)[1]
        if not isinstance(target, (list, tuple)):
            return [(lo, hi, canonical_view(spec, target, hi - lo))]
        rows = spec.part_intervals(lo, hi, len(target), self.plan.gen.vocab_chunk)
        return [(a, b, canonical_view(spec, part, b - a))
                for (a, b), part in zip(rows, target) if b > a]

    def _zero_padding(self, spec: ParamSpec, real: int) -> None:
        target = self._target(spec)[1]
        parts = target if isinstance(target, (list, tuple)) else [target]
        c = parts[0].shape[0]
        for k, part in enumerate(parts):  # padding rows never carry weights
            part[max(0, min(c, real - k * c)):].zero_()

    def _emit(self, spec: ParamSpec, piece: torch.Tensor) -> None:
        if self.into is not None:
            self._emit_into(spec, piece.shape[spec.cut_dim])
            return
        out = self.fmt(spec, piece)
        self.pending += out
        if self.sink is None:
            self.kept_bytes += piece.numel() * piece.element_size()
        else:
            self.pending_bytes += piece.numel() * piece.element_size()

    def _emit_into(self, spec: ParamSpec, real_rows: int) -> None:
        if spec.kind == "vocab" and self.zero_padding:
            self._zero_padding(spec, real_rows)
        self.pending.append(self._target(spec))

    def _region(self, key: str) -> list:
        """[segments [(first row, end row, canonical view)], rows filled] of ``key``'s dest."""
        if key not in self.regions:
            dlo, dhi = self.dests[key]
            if self.into is not None:
                segs = self._segments(self.gen_specs[key][0], dlo, dhi)
            else:
                buf = torch.empty(self.plan.spec(key).piece_shape(dhi - dlo), dtype=self.dtype,
                                  device=self.device)
                self.open_bytes += buf.numel() * buf.element_size()
                segs = [(dlo, dhi, buf)]
            self.regions[key] = [segs, 0]
        return self.regions[key]

    def slot(self, key: str, lo: int, hi: int) -> torch.Tensor | None:
        """Where rows [lo, hi) of ``key`` will live, if contiguous (receive straight into it)."""
        cut = self.plan.spec(key).cut_dim
        for a, b, view in self._region(key)[0]:
            if a <= lo and hi <= b:
                view = view.narrow(cut, lo - a, hi - lo)
                return view if view.is_contiguous() else None
        return None

    def accept(self, key: str, lo: int, hi: int, data: torch.Tensor | None) -> None:
        """Rows [lo, hi) of ``key`` in canonical layout (shape: piece_shape(hi - lo)); None:
        they were received straight into ``slot(key, lo, hi)``."""
        cut = self.plan.spec(key).cut_dim
        region = self._region(key)
        for a, b, view in region[0] if data is not None else ():
            x, y = max(a, lo), min(b, hi)
            if y <= x:
                continue
            target, src = view.narrow(cut, x - a, y - x), data.narrow(cut, x - lo, y - x)
            if target.data_ptr() != src.data_ptr():  # not received in place via ``slot``
                target.copy_(src)
                if self.copies is not None:  # recording a Replay (executor)
                    self.copies.append((target, src))
        region[1] += hi - lo
        if region[1] == self.dests[key][1] - self.dests[key][0]:
            self._complete(key)

    def _complete(self, key: str) -> None:
        segs, _ = self.regions.pop(key)
        dlo, dhi = self.dests[key]
        if self.into is not None:
            for spec in self.gen_specs.get(key, []):
                glo, ghi = self.plan.gen.interval(spec, self.rank)
                self._emit_into(spec, ghi - glo)
            return
        buf = segs[0][2]
        self.open_bytes -= buf.numel() * buf.element_size()
        for spec in self.gen_specs.get(key, []):
            glo, ghi = self.plan.gen.interval(spec, self.rank)
            piece = buf.narrow(spec.cut_dim, glo - dlo, ghi - glo)
            if (glo, ghi) != (dlo, dhi):
                piece = piece.clone()  # do not pin the full-tensor buffer of the baselines
            self._emit(spec, piece)

    def flush(self) -> None:
        """Hand the tensors completed since the last flush to the sink (or keep them)."""
        if not self.pending and not (self.sink_every_flush and self.sink is not None):
            return
        if self.sink is not None:
            self.sink(self.pending)
        else:
            self.kept.update(self.pending)
        self.pending, self.pending_bytes = [], 0

    def result(self) -> dict[str, torch.Tensor]:
        """After the run: the kept tensors by name (empty with a sink); AssertionError when a
        parameter is incomplete."""
        if self.regions:
            raise AssertionError(f"rank {self.rank}: incomplete parameters {sorted(self.regions)}")
        self.flush()
        return self.kept
