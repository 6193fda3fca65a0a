"""Rollouts partitioned over data parallelism: each DP replica receives only the rows it trains on.

Contract:
- ``TransportStats``: a rank's bytes of one hand-off; ``a + b`` sums them, ``metrics()`` is
  the step metric ``rollout/handoff_bytes`` (received: its rows plus the lengths).
- ``plan_rollout_partition(seq_lens, dp_size, chunk, group_size)`` (pure): the global rows of
  each DP rank, ascending. The batch is cut into consecutive chunks of ``chunk`` rows (the
  mini-batch granularity, so every PPO mini-batch is spread over all DP ranks and the updates see
  the same mini-batches as one process); in each chunk, units of ``group_size`` consecutive rows
  (the n samples of one prompt when the estimator needs its group, else single rows) are dealt
  to the DP ranks by Karmarkar-Karp on their token sums (equal unit counts per rank).
  ``ValueError`` when a chunk has fewer units than DP ranks.
- ``plan_transfers(owner, parts, replica_ranks)`` (pure): ``{(src, dst): rows}``: every row goes
  from the rank that generated it to every rank of the DP replica that trains on it (its TP and
  PP ranks all read the input ids); identical on every rank, each keeps its own pairs.
- ``exchange_rollouts(...)`` (collective, point to point): the generating ranks send each
  destination one flat int32 buffer per pair = (token ids of the rows' valid tokens, then their
  fp32 log-probs bit-cast to int32); no padding and no zero rows travel. Returns this rank's rows
  as a ``GenerationOutput`` [n_local, R] (R = the longest response of the whole batch, as the
  whole-batch path) and ``TransportStats`` (bytes received / sent over the network). With
  ``routing=(layers, k)`` and ``prompt_lens`` it also moves each row's MoE expert ids (routing
  replay: int16 sent as bytes, prompt + response tokens, one more message per pair) into the
  result's ``routed_experts`` (-1 past each row's tokens).
- ``pack_rows(rows, position, out, lens)`` / ``unpack_rows(buf, rows, lens, local, ids, mask,
  logp)``: that int32 buffer and back (also the split placement's hand-off,
  ``hybridrl.rollout.split.link``).
- ``rollout_bytes_model(...)`` (pure): bytes received per rank per step by today's whole-batch
  all_gather path and by this partitioned path, for benchmarks/ and docs/scaling.md.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from hybridrl.data.batching import karmarkar_karp
from hybridrl.rollout.base import GenerationOutput


@dataclasses.dataclass
class TransportStats:
    """Bytes this rank received / sent in one exchange (network only; local copies excluded)."""

    bytes_in: int = 0
    bytes_out: int = 0
    scalar_bytes: int = 0  # the per-sequence lengths every rank receives (4 bytes each)

    def __add__(self, other: TransportStats) -> TransportStats:
        return TransportStats(self.bytes_in + other.bytes_in, self.bytes_out + other.bytes_out,
                              self.scalar_bytes + other.scalar_bytes)

    def metrics(self) -> dict:
        """``rollout/handoff_bytes``: the bytes this rank received for its rows (and the
        lengths every rank receives) in the step's hand-offs."""
        return {"rollout/handoff_bytes": float(self.bytes_in + self.scalar_bytes)}


def plan_rollout_partition(seq_lens: list[int], dp_size: int, chunk: int,
                           group_size: int = 1) -> list[list[int]]:
    """Global rows of each DP rank (see the module docstring)."""
    n = len(seq_lens)
    if chunk < 1 or n % chunk or chunk % group_size:
        raise ValueError(f"plan_rollout_partition: {n} rows, chunk {chunk}, group {group_size}: "
                         "the chunk must divide the batch and be a multiple of the group")
    if chunk // group_size < dp_size:
        raise ValueError(f"a mini-batch of {chunk} sequences holds {chunk // group_size} units of "
                         f"{group_size} (prompt groups or rows) but dp_size={dp_size}: raise "
                         "ppo_mini_batch_size to at least dp_size")
    parts: list[list[int]] = [[] for _ in range(dp_size)]
    for start in range(0, n, chunk):
        units = [list(range(s, s + group_size)) for s in range(start, start + chunk, group_size)]
        weights = [sum(int(seq_lens[i]) for i in u) for u in units]
        for d, picked in enumerate(karmarkar_karp(weights, dp_size, equal_size=True)):
            parts[d].extend(i for u in picked for i in units[u])
    return [sorted(p) for p in parts]


def plan_transfers(owner: list[int], parts: list[list[int]],
                   replica_ranks: list[list[int]]) -> dict[tuple[int, int], list[int]]:
    """``{(src, dst): ascending rows}`` for every row and every rank of its DP replica."""
    out: dict[tuple[int, int], list[int]] = {}
    for d, rows in enumerate(parts):
        for row in rows:
            for dst in replica_ranks[d]:
                out.setdefault((owner[row], dst), []).append(row)
    return out


def pack_rows(rows: list[int], position: dict[int, int], out: GenerationOutput,
          lens: list[int]) -> torch.Tensor:
    """int32 [2·tokens]: the valid token ids of ``rows``, then their log-probs' fp32 bits."""
    ids, logp = [], []
    for row in rows:
        j, n = position[row], lens[row]
        ids.append(out.response_ids[j, :n])
        logp.append(out.logprobs[j, :n])
    if not ids:
        return torch.empty(0, dtype=torch.int32)
    return torch.cat([torch.cat(ids).to(torch.int32),
                      torch.cat(logp).float().contiguous().view(torch.int32)])


def unpack_rows(buf: torch.Tensor, rows: list[int], lens: list[int], local: dict[int, int],
            ids_NR: torch.Tensor, mask_NR: torch.Tensor, logp_NR: torch.Tensor) -> None:
    total = sum(lens[r] for r in rows)
    buf = buf.cpu()
    ids, logp = buf[:total].long(), buf[total:].contiguous().view(torch.float32)
    at = 0
    for row in rows:
        j, n = local[row], lens[row]
        ids_NR[j, :n], logp_NR[j, :n] = ids[at:at + n], logp[at:at + n]
        mask_NR[j, :n] = 1
        at += n


def check_prefix_mask(out: GenerationOutput) -> list[int]:
    """Response lengths of ``out``; ValueError when a row's mask is not 1s then 0s."""
    lens = out.response_mask.sum(-1)
    cols = torch.arange(out.response_mask.shape[1])
    bad = ((cols[None, :] < lens[:, None]).long() != out.response_mask.long().cpu()).any(-1)
    if bool(bad.any()):
        raise ValueError(f"rollout rows {torch.nonzero(bad).flatten().tolist()[:5]}: the response "
                         "mask must be 1 on the first tokens then 0 (right padding)")
    return [int(v) for v in lens]


def pack_routing(rows: list[int], position: dict[int, int], routed: torch.Tensor,
                 spans: list[int]) -> torch.Tensor:
    """uint8 bytes of the int16 expert ids [span, layers, k] of ``rows`` (token t at column t)."""
    parts = [routed[position[row], :spans[row]].to(torch.int16).reshape(-1) for row in rows]
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(parts).contiguous().view(torch.uint8)


def unpack_routing(buf: torch.Tensor, rows: list[int], spans: list[int], local: dict[int, int],
                   routed_NTLK: torch.Tensor) -> None:
    ids = buf.cpu().contiguous().view(torch.int16)
    per_token = routed_NTLK.shape[2] * routed_NTLK.shape[3]
    at = 0
    for row in rows:
        n = spans[row] * per_token
        routed_NTLK[local[row], :spans[row]] = ids[at:at + n].view(spans[row], *routed_NTLK.shape[2:])
        at += n


def exchange_rollouts(rank: int, transfers: dict, mine: list[int], src_rows: list[int],
                      src_out: GenerationOutput | None, lens: list[int], pad_token_id: int,
                      device, routing: tuple[int, int] | None = None,
                      prompt_lens: list[int] | None = None
                      ) -> tuple[GenerationOutput, TransportStats]:
    """This rank's rows ``mine`` (ascending global rows) from their generating ranks.

    ``routing`` = (layers, k) also moves each row's ``routed_experts`` (a MoE engine's top-k ids
    of its prompt_lens[row] + lens[row] tokens, int16 as bytes: NCCL has no int16), one more
    message per (source, destination) pair posted right after that pair's rows; the result's
    ``routed_experts`` is [rows, longest span, layers, k], -1 past each row's span."""
    stats = TransportStats()
    position = {row: j for j, row in enumerate(src_rows)}
    local = {row: j for j, row in enumerate(mine)}
    R = max(1, max(lens))
    ids = torch.full((len(mine), R), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(mine), R, dtype=torch.long)
    logp = torch.zeros(len(mine), R, dtype=torch.float32)
    routed = spans = None
    if routing is not None:
        spans = [p + n for p, n in zip(prompt_lens, lens)]
        width = max([spans[r] for r in mine], default=1)
        routed = torch.full((len(mine), width, *routing), -1, dtype=torch.int16)
        per_token = 2 * routing[0] * routing[1]
    ops, recvs = [], []
    for (src, dst), rows in sorted(transfers.items()):
        if src == rank and dst == rank:
            unpack_rows(pack_rows(rows, position, src_out, lens), rows, lens, local, ids, mask, logp)
            if routed is not None:
                unpack_routing(pack_routing(rows, position, src_out.routed_experts, spans), rows,
                               spans, local, routed)
        elif src == rank:
            bufs = [pack_rows(rows, position, src_out, lens).to(device)]
            if routed is not None:
                bufs.append(pack_routing(rows, position, src_out.routed_experts, spans).to(device))
            for buf in bufs:
                stats.bytes_out += buf.numel() * buf.element_size()
                ops.append(dist.P2POp(dist.isend, buf, dst))
        elif dst == rank:
            buf = torch.empty(2 * sum(lens[r] for r in rows), dtype=torch.int32, device=device)
            stats.bytes_in += buf.numel() * 4
            ops.append(dist.P2POp(dist.irecv, buf, src))
            route = None
            if routed is not None:
                route = torch.empty(per_token * sum(spans[r] for r in rows), dtype=torch.uint8,
                                    device=device)
                stats.bytes_in += route.numel()
                ops.append(dist.P2POp(dist.irecv, route, src))
            recvs.append((buf, route, rows))
    ops = [op for op in ops if op.tensor.numel() > 0]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for buf, route, rows in recvs:
        unpack_rows(buf, rows, lens, local, ids, mask, logp)
        if route is not None:
            unpack_routing(route, rows, spans, local, routed)
    return GenerationOutput(ids, mask, logp, routed_experts=routed), stats


def rollout_bytes_model(n_seqs: int, mean_len: float, max_len: int, world: int, dp: int,
                        gen_tp: int) -> dict[str, float]:
    """Bytes received per rank per step: ``allgather`` (today: a [rows, 1 + 3R] float64 tensor
    from every rank, zero rows from non-source gen-TP ranks, padded to the largest share) and
    ``partitioned`` (an upper bound: the rank's DP share of valid tokens as int32 ids + fp32
    log-probs, plus one int32 length per sequence; rows generated on the rank itself are copied,
    not received). ``useful`` = the rank's own share at 8 bytes per valid token."""
    rows_max = math.ceil(n_seqs / (world // gen_tp))
    allgather = world * rows_max * (1 + 3 * max_len) * 8 + world * 16
    share = n_seqs / dp * mean_len * 8
    return {"allgather": float(allgather), "partitioned": share + 4.0 * n_seqs, "useful": share}
