"""Masks for workers of different capacities (`masking.capacity`): each worker holds its own share.

Worker k holds a fraction c_k of the units (its capacity: a 24 GB card less than an 80 GB
one). The construction lays the workers' arcs end to end around each group's units: with the
units on a circle of n positions and P_k = c_0 + ... + c_{k-1}, worker k holds the positions
[round(n P_k), round(n P_{k+1})) taken mod n. Since the arcs tile the line [0, n T), T = the
sum of the capacities, every unit has floor(T) or ceil(T) holders (as even as the capacities
allow; at least one when T >= 1), and each worker holds floor(n c_k) or ceil(n c_k) units of
every group: its share, to within one unit. No worker's arc is longer than the circle
(c_k <= 1), so no worker holds a unit twice.

- A neuron group (FFN units, heads, channels) is its own circle. Its boundaries are rounded
  with an offset that turns with the group's index among the groups of its kind, so the
  one-unit rounding differences fall on different workers from layer to layer. (Rounding
  moves a boundary by less than a unit, not the workers' order around the circle: the holder
  sets stay the same few in every group.)
- Block units (one unit per group) are laid on one circle of all the blocks, each as long as
  its parameters, in residue order (block l at the place of (l mod K, l div K)), and a worker
  holds the blocks whose middles lie in its arc. Its blocks are then its capacity's share of
  the blocks' parameters (the memory it has), to within one block, and spread through the
  whole depth rather than a run of adjacent layers. A worker whose share is below the largest
  block's could miss every middle: refused.

Every group's holder sets are the arcs' overlaps, the same few sets in every group (the
workers' order around the circle is fixed), so a rank joins few process groups.

Resampling (mask epoch e > 0) draws from (seed, e): each neuron circle is turned by a random
number of units, and the blocks are laid in a random order. Loads and holder sets stay those
of epoch 0; which units a worker holds changes.

Equal capacities whose sum is a whole number are the uniform mask (`build_mask` with
coverage = c), bitwise: a run with masking.capacity=[c]*K is the run with masking.coverage=c.
"""

from __future__ import annotations

import numpy as np

from sdp.errors import ConfigError
from sdp.subnet.mask import Mask, build_mask, rotations

KEY = "masking.capacity"
TOLERANCE = 1e-9


def capacity_mask(
    group_sizes: list[int],
    *,
    capacity: list[float],
    construction: str = "cyclic",
    seed: int = 0,
    group_kinds: list[str] | None = None,
    group_names: list[str] | None = None,
    unit_numels: list[int] | None = None,
    epoch: int = 0,
) -> Mask:
    """The mask of workers with capacities `capacity` (one per worker) over groups of `group_sizes`
    (`unit_numels`: the elements of one unit of each group, which weigh the blocks; default 1)."""
    kinds = group_kinds or ["unit"] * len(group_sizes)
    numels = unit_numels or [1] * len(group_sizes)
    k, total = len(capacity), sum(capacity)
    if len(set(capacity)) == 1 and abs(total - round(total)) <= TOLERANCE * k:  # the uniform mask, its rules
        return build_mask(
            group_sizes, num_workers=k, coverage=capacity[0], construction=construction, seed=seed,
            group_kinds=kinds, epoch=epoch,
        )  # fmt: skip
    names = group_names or [f"group {g}" for g in range(len(group_sizes))]
    check_capacity(capacity, group_sizes=group_sizes, group_kinds=kinds, group_names=names, unit_numels=numels)
    if construction != "cyclic":
        raise ConfigError(
            "masking.construction",
            construction,
            f"draws r holders per unit, which workers of different capacities ({KEY}) cannot give; "
            "allowed with a capacity list: cyclic",
        )
    rng = np.random.default_rng([seed, epoch]) if epoch > 0 else None
    members: list[np.ndarray] = [np.zeros((k, 0), dtype=bool)] * len(group_sizes)
    rot = rotations(kinds)
    for g, (n, kind) in enumerate(zip(group_sizes, kinds, strict=True)):
        if kind != "block":
            member = lay_arcs(n, capacity, offset=(rot[g] % k + 0.5) / k)
            members[g] = member if rng is None else np.roll(member, int(rng.integers(n)), axis=1)
    blocks = [g for g, kind in enumerate(kinds) if kind == "block"]
    if blocks:
        order = residue_order(len(blocks), k) if rng is None else rng.permutation(len(blocks)).tolist()
        weights = np.array([numels[blocks[i]] for i in order], dtype=np.float64)
        middles = (np.cumsum(weights) - weights / 2) / weights.sum()
        held = cover_points(middles, capacity)
        for place, i in enumerate(order):
            members[blocks[i]] = held[:, place : place + 1]
    return _as_mask(members, capacity)


def lay_arcs(n: int, capacity: list[float], *, offset: float = 0.5) -> np.ndarray:
    """member[k, u]: whether worker k holds position u of a circle of n units, the workers'
    arcs laid end to end, each boundary n P_k rounded down after adding `offset` (in [0, 1))."""
    k = len(capacity)
    bounds = np.floor(n * np.cumsum([0.0, *capacity]) + offset).astype(np.int64)
    member = np.zeros((k, n), dtype=bool)
    for w in range(k):
        member[w, np.arange(bounds[w], bounds[w + 1]) % n] = True
    return member


def cover_points(points: np.ndarray, capacity: list[float]) -> np.ndarray:
    """member[k, i]: whether point i of the unit circle lies in worker k's arc, the arcs
    [P_k, P_k + c_k) laid end to end and taken mod 1."""
    starts = np.cumsum([0.0, *capacity])[:-1]
    return np.stack([(points - p) % 1.0 < c for p, c in zip(starts, capacity, strict=True)])


def residue_order(num_blocks: int, num_workers: int) -> list[int]:
    """Blocks in order of (l mod K, l div K): contiguous places are blocks spread through the depth."""
    return sorted(range(num_blocks), key=lambda block: (block % num_workers, block // num_workers))


def _as_mask(members: list[np.ndarray], capacity: list[float]) -> Mask:
    """The Mask whose chunk c of group g is the units of g with one holder set."""
    chunk_of, chunk_holders, chunk_source = [], [], []
    for g, member in enumerate(members):
        sets, inverse = np.unique(member.T, axis=0, return_inverse=True)
        holders = tuple(tuple(int(w) for w in np.flatnonzero(row)) for row in sets)
        chunk_of.append(inverse.reshape(-1).astype(np.int64))
        chunk_holders.append(holders)
        # The sender of chunk c turns with c and g, so that the holders take turns.
        chunk_source.append(tuple(hs[(c + g) % len(hs)] for c, hs in enumerate(holders)))
    return Mask(
        num_workers=len(capacity),
        holders=None,
        capacity=tuple(capacity),
        chunk_of=tuple(chunk_of),
        chunk_holders=tuple(chunk_holders),
        chunk_source=tuple(chunk_source),
    )


def check_capacity(
    capacity: list[float],
    *,
    group_sizes: list[int],
    group_kinds: list[str],
    group_names: list[str],
    unit_numels: list[int],
) -> None:
    """The refusals of a capacity list the model's units cannot meet (ConfigError): a sum below 1
    (a unit without a holder), and a share too small to hold one unit of some group, or the
    largest block (a worker's blocks are its share of all the blocks' parameters)."""
    total = sum(capacity)
    if total < 1 - TOLERANCE:
        raise ConfigError(
            KEY,
            capacity,
            f"sums to {total:.6g}, below 1: some unit would have no holder; capacities summing to 1 or more "
            f"would work (each unit then has about their sum in holders), for example {_scaled_to_one(capacity)}",
        )
    worker = min(range(len(capacity)), key=lambda w: capacity[w])
    blocks = [
        (numel, name)
        for numel, kind, name in zip(unit_numels, group_kinds, group_names, strict=True)
        if kind == "block"
    ]
    largest, name = max(blocks, key=lambda b: b[0], default=(0, ""))
    share = largest / sum(numel for numel, _ in blocks) if blocks else 0.0
    if capacity[worker] < share - TOLERANCE:  # an arc shorter than the largest block may miss every block's middle
        raise ConfigError(
            KEY,
            capacity,
            f"gives worker {worker} a share of {capacity[worker]:g} of the blocks' parameters, less than the "
            f"largest block ({name}: {share:.3g} of them), which every worker must be able to hold; every capacity "
            f"must be at least {share:.4g} with this model's {len(blocks)} blocks, or use masking.granularity=neuron",
        )
    sizes = [(n, name) for n, kind, name in zip(group_sizes, group_kinds, group_names, strict=True) if kind != "block"]
    if not sizes:
        return
    n, name = min(sizes)
    if capacity[worker] * n < 1 - TOLERANCE:
        raise ConfigError(
            KEY,
            capacity,
            f"gives worker {worker} a share of {capacity[worker]:g} x {n} = {capacity[worker] * n:.3g} units of "
            f"{name}, less than one; every capacity must be at least 1/{n} = {1 / n:.4g} with this model",
        )


def _scaled_to_one(capacity: list[float]) -> str:
    """The list scaled up so that it sums to 1 (each entry rounded up, at most 1)."""
    total = sum(capacity)
    return "[" + ",".join(f"{min(1.0, np.ceil(c / total * 1000) / 1000):g}" for c in capacity) + "]"


def listed(capacity) -> str:
    """A capacity list as the command line takes it and labels show it: [1,1,0.5,0.5]."""
    return "[" + ",".join(f"{c:g}" for c in capacity) + "]"


def check_length(capacity: list[float], *, workers: int, fsdp_degree: int = 1) -> None:
    """One capacity per SDP worker (K = the world size, or the world / parallelism.fsdp_degree)."""
    if len(capacity) == workers:
        return
    world = "the world size" if fsdp_degree == 1 else f"the world size / parallelism.fsdp_degree={fsdp_degree}"
    raise ConfigError(
        KEY,
        capacity,
        f"has {len(capacity)} entries for K={workers} SDP workers ({world}); give one capacity per worker "
        f"(a resume on another world size needs the list for the new K), for example "
        f"masking.capacity=[{','.join(['1'] * min(workers, 2) + ['0.5'] * max(0, workers - 2))}]",
    )
