"""Masks: which worker holds which unit.

The mask is a pure function of (unit spec sizes, K, coverage, construction,
seed): every rank computes the same mask without communication.

Balanced cyclic construction (docs/sdp.md; the design: docs/architecture.md): the units of
every group are split into K chunks; worker k holds chunks k, k+1, ...,
k+r-1 (mod K) with r = C*K >= 1 (a whole number), so every chunk has exactly r holders
and every worker holds r of the K chunks of every group. Chunk boundaries are
rotated from group to group, so the one-unit differences between chunk sizes
average out over the depth; for block units (one unit per group) the rotation
puts block l in chunk l mod K, interleaving every worker's blocks through the
whole depth.

The random construction draws, for every (group, chunk), r distinct holders
uniformly at random: still r holders per unit, but loads vary by worker.

The blocked construction splits the workers into K / r blocks of r (r must divide K):
block b holds chunks b*r .. b*r + r - 1 of every group. Loads are as balanced as the
cyclic construction's, but no unit is shared across blocks, so the co-ownership graph
falls apart into K / r pieces and its spectral gap is 0: the poorest mixing a balanced
mask can have, for experiments on what the gap does to convergence.

Resampling (IST-style, `masking.resample_every`): mask epoch e > 0 is drawn
from (seed, e). Each neuron group's chunk boundaries are shifted by a random
number of units (circularly, so a chunk stays at most two contiguous runs and
slices stay cheap), and the rotations of the groups of each kind are
permuted and offset at random. Which units train together, and on which
workers, changes from epoch to epoch, while every invariant above holds:
r holders per unit and, for the cyclic construction, r chunks of every group
per worker, with per-kind loads that are epoch 0's loads handed to other
workers. Epoch 0 is the fixed mask.

Workers of different capacities (`masking.capacity`) get their masks from
`sdp.subnet.capacity`, in the same `Mask` form (holder sets per chunk), with `holders` None.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from sdp.errors import ConfigError


class Construction(StrEnum):
    cyclic = "cyclic"  # balanced: every chunk of units has the same number of holders
    random = "random"
    blocked = "blocked"  # balanced, and deliberately poorly mixing: K / r blocks that never meet


CONSTRUCTIONS = tuple(Construction)
# Constructions whose holder sets are the same in every mask epoch (only the chunks move).
FIXED_HOLDER_SETS = (Construction.cyclic, Construction.blocked)


def holders_per_unit(coverage: float, num_workers: int) -> int:
    """r = C*K: how many workers hold each unit. C*K must be a whole number >= 1, so that the
    coverage a run reports is the coverage it trains with."""
    if not 0.0 < coverage <= 1.0:
        raise ConfigError("masking.coverage", coverage, "must be in (0, 1]")
    r = int(np.floor(coverage * num_workers + 0.5))
    if r < 1 or abs(coverage * num_workers - r) > 1e-6:
        allowed = ", ".join(f"{h / num_workers:g}" for h in range(1, num_workers + 1))
        raise ConfigError(
            "masking.coverage",
            coverage,
            f"gives C x K = {coverage} x {num_workers} = {coverage * num_workers:.4g} holders per unit, which must "
            f"be a whole number >= 1; allowed with K={num_workers} workers: {allowed}",
        )
    return r


@dataclass(frozen=True)
class Mask:
    """Holder sets of every unit: `chunk_of[g][u]` is unit u's chunk in group g, and
    `chunk_holders[g][c]` the sorted workers holding chunk c of group g."""

    num_workers: int
    holders: int | None  # r, the holders of every unit; None for workers of different capacities
    chunk_of: tuple[np.ndarray, ...]
    chunk_holders: tuple[tuple[tuple[int, ...], ...], ...]
    # The holder that sends chunk c of group g to the other workers (weight refresh,
    # assembly): spread so that every worker sends about the same amount.
    chunk_source: tuple[tuple[int, ...], ...]
    capacity: tuple[float, ...]  # each worker's share of the units (r / K each for a uniform mask)

    def held_units(self, worker: int, group: int) -> np.ndarray:
        """Sorted unit indices of `group` held by `worker`."""
        held_chunks = [c for c, hs in enumerate(self.chunk_holders[group]) if worker in hs]
        return np.flatnonzero(np.isin(self.chunk_of[group], held_chunks))

    def holder_counts(self, group: int) -> np.ndarray:
        """How many workers hold each unit of `group`."""
        return np.array([len(hs) for hs in self.chunk_holders[group]], dtype=np.int64)[self.chunk_of[group]]

    def unit_holders(self, group: int) -> list[tuple[int, ...]]:
        """Holder set of every unit of `group`."""
        return [self.chunk_holders[group][c] for c in self.chunk_of[group]]

    def holder_sets(self) -> list[tuple[int, ...]]:
        """Distinct holder sets of the chunks that hold units, in a deterministic order (for
        process groups, created once). A block group is one unit, so K - 1 of its K chunks
        are empty: their holder sets need no group (with NCCL, no communicator)."""
        used = {
            hs
            for chunks, per_group in zip(self.chunk_of, self.chunk_holders, strict=True)
            for c, hs in enumerate(per_group)
            if (chunks == c).any()
        }
        return sorted(used, key=lambda s: (len(s), s))

    def matrix(self) -> np.ndarray:
        """M[k, u] in {0, 1} for K workers x all units (groups concatenated)."""
        cols = []
        for g, chunks in enumerate(self.chunk_of):
            member = np.zeros((self.num_workers, len(self.chunk_holders[g])), dtype=np.int8)
            for c, hs in enumerate(self.chunk_holders[g]):
                member[list(hs), c] = 1
            cols.append(member[:, chunks])
        return np.concatenate(cols, axis=1)


def chunk_ids(num_units: int, num_workers: int, *, rotation: int, shift: int = 0) -> np.ndarray:
    """Chunk of each unit: K near-equal contiguous chunks (circularly, starting at unit
    `shift`), chunk ids rotated by `rotation`."""
    position = (np.arange(num_units) + shift) % num_units
    return (position * num_workers // num_units + rotation) % num_workers


def rotations(group_kinds: list[str]) -> list[int]:
    """Each group's chunk rotation: its index among the groups of the same kind.

    Rotating per kind (FFN of layer l, heads of layer l, ...) spreads each
    kind's larger chunks over the workers, whatever the order kinds come in.
    """
    seen: dict[str, int] = {}
    out = []
    for kind in group_kinds:
        out.append(seen.get(kind, 0))
        seen[kind] = out[-1] + 1
    return out


def build_mask(
    group_sizes: list[int],
    *,
    num_workers: int,
    coverage: float,
    construction: str = "cyclic",
    seed: int = 0,
    group_kinds: list[str] | None = None,
    epoch: int = 0,
) -> Mask:
    """The mask for units in groups of `group_sizes` over `num_workers` workers.

    `group_kinds` (default: all one kind) sets the chunk rotation of each group;
    `epoch` > 0 draws a resampled mask (see the module doc).
    """
    if construction not in CONSTRUCTIONS:
        raise ConfigError("masking.construction", construction, f"allowed: {', '.join(CONSTRUCTIONS)}")
    if epoch < 0:
        raise ValueError(f"mask epoch must be >= 0, got {epoch}")
    k = num_workers
    r = holders_per_unit(coverage, k)
    kinds = group_kinds or ["unit"] * len(group_sizes)
    rot = rotations(kinds)
    shifts = [0] * len(group_sizes)
    # Epoch 0 keeps the seed-only stream of the random construction; later epochs draw from (seed, epoch).
    rng = np.random.default_rng(seed if epoch == 0 else [seed, epoch])
    if epoch > 0:
        rot, shifts = _resampled_layout(rot, kinds, group_sizes, num_workers=k, rng=rng)
    chunk_of = tuple(chunk_ids(n, k, rotation=rot[g], shift=shifts[g]) for g, n in enumerate(group_sizes))
    if construction == "cyclic":
        # Worker w holds chunks w..w+r-1, so chunk c is held by workers c-r+1..c.
        cyclic = tuple(tuple(sorted((c - i) % k for i in range(r))) for c in range(k))
        chunk_holders = tuple(cyclic for _ in group_sizes)
        # Chunk c is the first of worker c's chunks: each worker sends one chunk per group.
        chunk_source = tuple(tuple(range(k)) for _ in group_sizes)
    elif construction == "blocked":
        if k % r:
            raise ConfigError(
                "masking.construction",
                construction,
                f"needs the {r} holders per unit (C x K) to divide the {k} workers, which it splits into blocks",
            )
        # Chunk c is held by the block of worker c, and sent by worker c.
        blocked = tuple(tuple(range(c - c % r, c - c % r + r)) for c in range(k))
        chunk_holders = tuple(blocked for _ in group_sizes)
        chunk_source = tuple(tuple(range(k)) for _ in group_sizes)
    else:
        chunk_holders = tuple(
            tuple(tuple(sorted(rng.choice(k, size=r, replace=False).tolist())) for _ in range(k)) for _ in group_sizes
        )
        chunk_source = tuple(
            tuple(hs[(c + g) % r] for c, hs in enumerate(per_group)) for g, per_group in enumerate(chunk_holders)
        )
    return Mask(
        num_workers=k,
        holders=r,
        chunk_of=chunk_of,
        chunk_holders=chunk_holders,
        chunk_source=chunk_source,
        capacity=(r / k,) * k,
    )


def _resampled_layout(
    rot: list[int], kinds: list[str], group_sizes: list[int], *, num_workers: int, rng: np.random.Generator
) -> tuple[list[int], list[int]]:
    """A resampled epoch's rotations (permuted within each kind, plus a random offset per
    kind: each kind's rotations keep their multiset mod K, so loads stay balanced) and
    chunk-boundary shifts (uniform per group)."""
    out = list(rot)
    for kind in dict.fromkeys(kinds):
        members = [g for g, kd in enumerate(kinds) if kd == kind]
        offset = int(rng.integers(num_workers))
        for g, src in zip(members, rng.permutation(members), strict=True):
            out[g] = (rot[int(src)] + offset) % num_workers
    shifts = [int(rng.integers(n)) for n in group_sizes]
    return out, shifts


def mask_stats(mask: Mask, unit_numels: list[int]) -> dict:
    """What a run reports about its mask: coverage per worker (by parameters),
    holders per unit, and the spectral gap of the worker co-ownership graph.

    `unit_numels[g]` is the size of one unit of group g. The co-ownership
    matrix O[k, k'] counts the unit parameters workers k and k' both hold; with
    W = D^-1/2 O D^-1/2 (D the row sums), rho = 1 - lambda_2(W) is 0 when the
    workers split into groups that never average together and 1 when every
    worker holds everything. This is our reading of the constant in the
    paper's bound (the exact definition is not available here).
    """
    m = mask.matrix().astype(np.float64)
    weights = np.concatenate(
        [np.full(len(c), w, dtype=np.float64) for c, w in zip(mask.chunk_of, unit_numels, strict=True)]
    )
    per_worker = m @ weights / weights.sum()
    co = (m * weights) @ m.T
    d = co.sum(axis=1)
    if np.any(d == 0):
        rho = 0.0
    else:
        norm = co / np.sqrt(np.outer(d, d))
        eig = np.sort(np.linalg.eigvalsh(norm))[::-1]
        rho = float(1.0 - eig[1]) if len(eig) > 1 else 1.0
    holders = m.sum(axis=0)
    return {
        "holders_per_unit": mask.holders,  # None when the workers' capacities differ
        "holders_min": int(holders.min()),
        "holders_mean": round(float(holders.mean()), 6),
        "holders_max": int(holders.max()),
        "capacity": list(mask.capacity),
        "coverage_target": (mask.holders or sum(mask.capacity)) / mask.num_workers,
        "coverage_per_worker": [round(float(c), 6) for c in per_worker],
        "spectral_gap": round(rho, 6),
        "holder_sets": len(mask.holder_sets()),
    }


def holder_runs(mask: Mask, group: int) -> list[list]:
    """Group `group`'s units as runs of consecutive units with one holder set, each
    [first unit, units, holders]: every unit's holders, compactly (a cyclic mask's chunks are runs)."""
    runs: list[list] = []
    for unit, holders in enumerate(mask.unit_holders(group)):
        if runs and runs[-1][2] == list(holders) and runs[-1][0] + runs[-1][1] == unit:
            runs[-1][1] += 1
        else:
            runs.append([unit, 1, list(holders)])
    return runs
