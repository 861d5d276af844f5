"""Process groups of holder sets, and what a rank pays for them.

One process group per distinct holder set, created once, in the same order on
every rank (torch requires every rank to take part in every `new_group`).
A rank is a member of the groups of the holder sets it belongs to; with NCCL
each of those is a communicator, which costs device memory (about half a GiB
each on A100s, NVIDIA/nccl#964). The cyclic construction has K holder sets, of
which each worker is in r = C x K; the random one draws up to C(K, r) of them,
and each resample may add more (groups are kept for the rest of the run).

Under SDP x FSDP the holders are workers of F ranks each: a holder set's
gradient shards are averaged over the holders' ranks of one shard index
({h*F + f}), so a holder set has F groups, plus one over all of its holders'
ranks when some tensors are replicated on a worker's ranks; the holder set of
every worker uses the mesh's sdp-dimension groups, which exist anyway.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from sdp.subnet.units import UnitSpec

REPLICATED = None  # shard_dims value of a tensor kept whole on each rank of its worker


def shard_dims(spec: UnitSpec, shapes: dict[str, torch.Size], fsdp_degree: int) -> dict[str, int | None]:
    """For every neuron-sliced parameter under SDP x FSDP: the dimension FSDP shards it along
    (REPLICATED: none).

    A dimension SDP does not slice has the same size on every worker, so shard f
    covers the same positions on every holder. Parameters not listed (shared
    tensors, block units) take FSDP's default, dim 0.
    """
    out: dict[str, int | None] = {}
    for group in spec.groups:
        for s in group.slices:
            if s.dim is None or s.is_buffer or s.name not in shapes:
                continue
            shape = shapes[s.name]
            if s.dim != 0:
                out[s.name] = 0
                continue
            even = [j for j in range(1, len(shape)) if shape[j] % fsdp_degree == 0]
            out[s.name] = max(even, key=lambda j: (shape[j], -j)) if even else REPLICATED
    return out


def ranks_of(workers: tuple[int, ...], shard: int | None, *, fsdp_degree: int) -> tuple[int, ...]:
    """The ranks of `workers` that hold shard `shard` (None: all their ranks); rank = worker * F + shard."""
    shards = range(fsdp_degree) if shard is None else [shard]
    return tuple(w * fsdp_degree + f for w in workers for f in shards)


def rank_sets(holder_sets: Iterable[tuple[int, ...]], *, fsdp_degree: int, replicated: bool) -> list[tuple[int, ...]]:
    """The rank sets whose groups serve these holder sets of workers (with F = 1, the sets themselves)."""
    holder_sets = list(holder_sets)
    sets = [ranks_of(hs, f, fsdp_degree=fsdp_degree) for hs in holder_sets for f in range(fsdp_degree)]
    if replicated:
        sets += [ranks_of(hs, None, fsdp_degree=fsdp_degree) for hs in holder_sets]
    return sets


def sdp_dimension_sets(workers: int, *, fsdp_degree: int) -> list[tuple[int, ...]]:
    """The rank sets of the SDP x FSDP mesh's sdp dimension ({k * F + f : every k}, one per shard
    index f): the holder set of every worker at each shard index, served by the mesh's groups."""
    return [ranks_of(tuple(range(workers)), f, fsdp_degree=fsdp_degree) for f in range(fsdp_degree)]


def joined(sets: Iterable[tuple[int, ...]], *, rank: int, world_size: int) -> int:
    """How many process groups `rank` is a member of among these rank sets, WORLD not counted
    (a set of every rank is WORLD; a single rank needs no group)."""
    return sum(1 for s in set(sets) if 1 < len(s) < world_size and rank in s)


class HolderGroups:
    """Process groups for sets of ranks; a single rank needs none, all ranks use WORLD."""

    def __init__(self, holder_sets: Iterable[tuple[int, ...]], *, world_size: int):
        self.world_size = world_size
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self.add(holder_sets)

    def add(self, holder_sets: Iterable[tuple[int, ...]]) -> None:
        """Create the groups of sets not seen yet (collective: every rank, same sets, one order)."""
        for hs in sorted(set(holder_sets) - self._groups.keys(), key=lambda s: (len(s), s)):
            if len(hs) == self.world_size:
                self._groups[hs] = dist.group.WORLD
            elif len(hs) > 1:
                self._groups[hs] = dist.new_group(list(hs))
            else:
                self._groups[hs] = None

    def adopt(self, sets: list[tuple[int, ...]], *, rank: int, group) -> None:
        """Serve these rank sets with a group that exists already (the member `rank` is in:
        `group`; the others it is not in), instead of making new ones; every rank adopts the
        same sets before it adds others, so all of them skip the same `new_group` calls."""
        for hs in sets:
            self._groups.setdefault(hs, group if rank in hs else dist.GroupMember.NON_GROUP_MEMBER)

    def get(self, holders: tuple[int, ...]):
        return self._groups[holders]

    def joined(self, rank: int) -> int:
        """How many of these groups `rank` is a member of, WORLD not counted."""
        return joined(self._groups, rank=rank, world_size=self.world_size)
