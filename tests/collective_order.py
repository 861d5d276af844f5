"""Checks on recorded collective orders: can every rank's sequence be one global order's subsequence?

NCCL runs a communicator's collectives in the order they are issued, and a rank
blocks in a collective until all of its group's members have reached it. A job
is safe when one global order of all its collectives exists of which every
rank's issued sequence is a subsequence: then the first unfinished collective
of that order always has all of its members waiting in it. This module finds
such an order or the reason there is none. It trusts nothing the code under
test says about its order: it reads only what each rank recorded.
"""

from __future__ import annotations

import itertools
from collections import defaultdict


def _group(g, world_size: int) -> tuple[int, ...]:
    return tuple(range(world_size)) if g == "world" else tuple(g)


def order_problems(traces: list[list], *, world_size: int) -> list[str]:
    """Why no global order fits `traces` (traces[r]: rank r's [group, kind, index] in issue
    order; group "world" is every rank); [] when one does."""
    problems = []
    # Each collective is (group, kind, index, n): the n-th time this rank issued it.
    seqs = []
    for rank, trace in enumerate(traces):
        seen: dict[tuple, int] = defaultdict(int)
        seq = []
        for g, kind, index in trace:
            group = _group(g, world_size)
            if rank not in group:
                problems.append(f"rank {rank} issued a collective of group {group}, which it is not in")
            key = (group, kind, index)
            seq.append((*key, seen[key]))
            seen[key] += 1
        seqs.append(seq)
    # Within a group, every member issues the same collectives in the same order.
    groups = {c[0] for seq in seqs for c in seq}
    for group in sorted(groups):
        per_member = {r: [c for c in seqs[r] if c[0] == group] for r in group}
        first = per_member[group[0]]
        for r, sub in per_member.items():
            if sub != first:
                problems.append(
                    f"group {group}: rank {r} issued {sub[:4]}... where rank {group[0]} issued {first[:4]}..."
                )
    # Across groups: each rank's sequence orders its collectives; a cycle means no global order.
    after: dict[tuple, set] = defaultdict(set)
    nodes = {c for seq in seqs for c in seq}
    for seq in seqs:
        for a, b in itertools.pairwise(seq):
            after[a].add(b)
    indegree = {n: 0 for n in nodes}
    for a in after:
        for b in after[a]:
            indegree[b] += 1
    ready = [n for n, d in indegree.items() if d == 0]
    placed = 0
    while ready:
        n = ready.pop()
        placed += 1
        for b in after[n]:
            indegree[b] -= 1
            if indegree[b] == 0:
                ready.append(b)
    if placed < len(nodes):
        stuck = sorted(n for n, d in indegree.items() if d > 0)
        problems.append(f"no global order: {len(stuck)} collectives wait on each other in a cycle, e.g. {stuck[:3]}")
    return problems
