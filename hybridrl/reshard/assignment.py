"""Placement-optimal generation coordinates when the gen shards do not nest (tg > t or pg > p).

Contract:
- ``optimal_coords(train, specs, tp, pp, vocab_chunk)`` returns, for every rank, its generation
  coordinates ``(gen_tp, gen_pp, replica)`` chosen so that the ranks keep the most elements they
  already hold: the p2p reshard then moves the fewest bytes in total (the minimum over every
  assignment of ranks to gen shards; tests check it against brute force). Pure: no process group.
- What a rank keeps depends only on its training shard ``(tp_rank, pp_rank)`` and its gen shard
  ``(gen_tp, gen_pp)`` (``kept_matrix``, in elements, summed over parameters exactly as the
  planner counts them: a key's destination rows intersected with every copy the rank holds).
- Solving: with L = lcm(t*p, tg*pg), the ranks in training (dp, pp, tp) order are cut into blocks
  of L (whole training DP replicas; when tg*pg | t*p a block is ONE replica, so every gen replica
  lies inside a training DP replica, as with the ``consecutive`` grouping). Each block holds every
  training shard L/(t*p) times and fills every gen shard L/(tg*pg) times, so one L x L assignment
  problem (``min_cost_assignment``, Hungarian method) solved once serves every block; the block
  optimum times the number of blocks is the global optimum (the transportation problem is
  integral). Ties go to the ``consecutive`` slot of a rank, so where that grouping is already
  optimal nothing moves. A gen shard's copies in a block become its replicas in rank order.
- Blocks larger than ``MAX_BLOCK`` ranks (exotic, non-power-of-two layouts) are not solved:
  ``optimal_coords`` returns None and the caller keeps the consecutive grouping.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hybridrl.reshard.specs import ParamSpec

MAX_BLOCK = 192  # the O(L^3) solve stays well under a second up to here


def min_cost_assignment(cost: Sequence[Sequence[int]]) -> list[int]:
    """Column of each row minimizing the summed cost of a square matrix (Hungarian method with
    potentials, O(n^3)); the first optimum found scanning columns in order (deterministic)."""
    n = len(cost)
    if any(len(row) != n for row in cost):
        raise ValueError(f"cost must be square, got {n} rows of lengths {sorted({len(r) for r in cost})}")
    inf = float("inf")
    u, v = [0] * (n + 1), [0] * (n + 1)
    match, way = [0] * (n + 1), [0] * (n + 1)  # match[j]: row (1-based) on column j; 0 = free
    for i in range(1, n + 1):
        match[0], j0 = i, 0
        minv, used = [inf] * (n + 1), [False] * (n + 1)
        while True:  # grow a shortest alternating path from row i to a free column
            used[j0] = True
            i0, row, delta, j1 = match[j0], cost[match[j0] - 1], inf, 0
            for j in range(1, n + 1):
                if not used[j]:
                    reduced = row[j - 1] - u[i0] - v[j]
                    if reduced < minv[j]:
                        minv[j], way[j] = reduced, j0
                    if minv[j] < delta:
                        delta, j1 = minv[j], j
            for j in range(n + 1):
                if used[j]:
                    u[match[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if match[j0] == 0:
                break
        while j0:  # flip the path
            j1 = way[j0]
            match[j0] = match[j1]
            j0 = j1
    cols = [0] * n
    for j in range(1, n + 1):
        cols[match[j] - 1] = j - 1
    return cols


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def kept_matrix(train, specs: Sequence[ParamSpec], tp: int, pp: int,
                vocab_chunk: int) -> list[list[int]]:
    """K[b + t*a][g + tg*q]: elements a rank with training shard (b, a) keeps of gen shard (g, q).

    ``train`` is the training ``Placement``; (tp, pp, vocab_chunk) describe the gen layout.
    """
    t, p, layers = train.tp, train.pp, train.num_layers
    by_key: dict[str, list[ParamSpec]] = {}
    for s in specs:
        by_key.setdefault(s.key, []).append(s)
    out = [[0] * (tp * pp) for _ in range(t * p)]
    memo: dict = {}
    for key, group in by_key.items():
        first = group[0]
        sig = key if (first.layer is None or len(group) > 1) else (
            first.kind, first.shape, first.unit, first.stage(p, layers), first.stage(pp, layers))
        if sig not in memo:
            memo[sig] = _key_kept(group, t, p, train.vocab_chunk, tp, pp, vocab_chunk, layers)
        for (i, j), n in memo[sig].items():
            out[i][j] += n
    return out


def _key_kept(group, t, p, train_chunk, tg, pg, gen_chunk, layers) -> dict:
    """{(train type, gen type): kept elements} of one key (every name storing it)."""
    dests = {}
    for q in range(pg):
        for g in range(tg):
            for s in group:  # as the planner's destinations(): the key's rows on this gen shard
                if s.on_stage(pg, layers, q):
                    iv = s.tp_interval(tg, g, gen_chunk)
                    if iv[1] > iv[0]:
                        dests[g + tg * q] = iv
    out = {}
    row_numel = group[0].row_numel
    for a in range(p):
        for b in range(t):
            held = [s.tp_interval(t, b, train_chunk) for s in group if s.on_stage(p, layers, a)]
            for j, iv in dests.items():
                # the copies of one key on one rank are the same rows (tied copy: another stage)
                n = max((_overlap(iv, h) for h in held), default=0)
                if n:
                    out[(b + t * a, j)] = n * row_numel
    return out


def optimal_coords(train, specs: Sequence[ParamSpec], tp: int, pp: int,
                   vocab_chunk: int) -> tuple[tuple[int, int, int], ...] | None:
    """Gen (tp_rank, pp_rank, replica) of every rank maximizing the elements kept (module doc)."""
    t, p, world = train.tp, train.pp, train.world
    big = math.lcm(t * p, tp * pp)
    if big > MAX_BLOCK:
        return None
    order = sorted(range(world), key=lambda r: (train.coords[r][2], train.coords[r][1],
                                                train.coords[r][0]))
    if train.experts is not None:  # experts over ep / etp: the dense weights decide
        specs = [s for s in specs if s.expert is None]
    kept = kept_matrix(train, specs, tp, pp, vocab_chunk)
    ntype = tp * pp
    # row i of a block: its i-th rank; column i: gen type i % ntype (copy i // ntype), so the
    # identity is the consecutive grouping; ties go to it (the +1 off the diagonal)
    scale = big + 1
    types = [train.coords[r][0] + t * train.coords[r][1] for r in order[:big]]
    cost = [[-kept[types[i]][j % ntype] * scale + (i != j) for j in range(big)]
            for i in range(big)]
    cols = min_cost_assignment(cost)
    per_block = big // ntype
    coords: list = [None] * world
    for block in range(world // big):
        copies = [0] * ntype
        for i in range(big):
            j = cols[i] % ntype
            coords[order[block * big + i]] = (j % tp, j // tp, block * per_block + copies[j])
            copies[j] += 1
    return tuple(coords)
