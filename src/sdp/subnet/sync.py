"""Communication among holders: gradient averaging, weight refresh, assembly.

One process group per distinct holder set, created once, in the same order
on every rank (torch requires every rank to take part in every `new_group`).
Gradients are averaged among a unit's holders only: all_reduce(SUM) over the
holder set's group, then division by the number of holders.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sdp.metrics.comm import CommCounter
from sdp.metrics.memory import local


class HolderGroups:
    """Process groups for holder sets; a single holder needs none, all workers use WORLD."""

    def __init__(self, holder_sets: Iterable[tuple[int, ...]], *, world_size: int):
        self.world_size = world_size
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self.add(holder_sets)

    def add(self, holder_sets: Iterable[tuple[int, ...]]) -> None:
        """Create the groups of holder sets not seen yet (collective: every rank, same sets)."""
        for hs in sorted(set(holder_sets) - self._groups.keys(), key=lambda s: (len(s), s)):
            if len(hs) == self.world_size:
                self._groups[hs] = dist.group.WORLD
            elif len(hs) > 1:
                self._groups[hs] = dist.new_group(list(hs))
            else:
                self._groups[hs] = None

    def get(self, holders: tuple[int, ...]):
        return self._groups[holders]


@dataclass(frozen=True)
class Piece:
    """A contiguous part of a local tensor: `tensor.narrow(dim, start, length)`, or all of it."""

    tensor: torch.Tensor
    dim: int | None
    start: int = 0
    length: int = 0

    def view(self, t: torch.Tensor | None = None) -> torch.Tensor:
        t = self.tensor if t is None else t
        return t if self.dim is None else t.narrow(self.dim, self.start, self.length)

    @property
    def numel(self) -> int:
        return self.tensor.numel() if self.dim is None else self.view().numel()


@dataclass(frozen=True)
class GradEntry:
    """A trainable piece, whose gradient is averaged over `holders`, and where it sits
    in the plain model: `name`, along `full_dim` (None: the whole tensor) from `full_start`."""

    holders: tuple[int, ...]
    kind: str  # comm counter label: grad_sync (units) | shared_sync (shared parameters)
    piece: Piece
    name: str
    full_dim: int | None = None
    full_start: int = 0


def _buckets(items: list, *, numel: Callable, cap_elems: int):
    """Consecutive runs of `items` of at most cap_elems elements (an item larger than the cap is alone)."""
    bucket, size = [], 0
    for item in items:
        n = numel(item)
        if bucket and size + n > cap_elems:
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += n
    if bucket:
        yield bucket


class GradSync:
    """Average each trainable piece's gradient over its holders, bucketed per holder set.

    Each entry's `piece.tensor` is a trainable parameter of this rank.
    """

    def __init__(
        self,
        entries: list[GradEntry],
        *,
        groups: HolderGroups,
        comm: CommCounter,
        bucket_cap_mb: int,
    ):
        self.groups, self.comm = groups, comm
        self.cap_elems = bucket_cap_mb * 2**20 // 4
        by_key: dict[tuple, list[Piece]] = {}
        for e in entries:
            by_key.setdefault((e.holders, e.kind), []).append(e.piece)
        self.plan = sorted(by_key.items(), key=lambda kv: (len(kv[0][0]), kv[0][0], kv[0][1]))

    def __call__(self) -> None:
        for (holders, kind), pieces in self.plan:
            group = self.groups.get(holders)
            if group is None:  # a single holder: its gradient is already the average
                continue
            for bucket in _buckets(pieces, numel=lambda p: p.numel, cap_elems=self.cap_elems):
                grads = [p.view(local(p.tensor.grad)) for p in bucket]
                flat = torch.cat([g.reshape(-1) for g in grads])
                self.comm.add(kind, flat.numel() * flat.element_size())
                dist.all_reduce(flat, group=group)
                flat.div_(len(holders))
                offset = 0
                for g in grads:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()

    def global_norm(self, *, rank: int) -> torch.Tensor:
        """L2 norm of the whole model's averaged gradient: each piece counted once (by its first holder)."""
        device = self.plan[0][1][0].tensor.device
        total = torch.zeros((), dtype=torch.float64, device=device)
        for (holders, _), pieces in self.plan:
            if holders[0] != rank:
                continue
            for p in pieces:
                total += p.view(local(p.tensor.grad)).double().pow(2).sum()
        dist.all_reduce(total)
        return total.sqrt()


@dataclass(frozen=True)
class Transfer:
    """Values that flow from rank `source` to every rank: `src` is the sender's piece
    (None on other ranks), `dst` where this rank writes them (None: keep what it
    has, e.g. a holder whose own copy is already current)."""

    source: int
    numel: int
    src: Piece | None
    dst: Piece | None


def broadcast_from_holders(
    transfers: list[Transfer],
    *,
    rank: int,
    comm: CommCounter | None,
    kind: str,
    bucket_cap_mb: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Send every transfer's values from its source rank to all ranks (one broadcast per bucket)."""
    by_source: dict[int, list[Transfer]] = {}
    for t in transfers:
        by_source.setdefault(t.source, []).append(t)
    cap = bucket_cap_mb * 2**20 // 4
    for src in sorted(by_source):
        for bucket in _buckets(by_source[src], numel=lambda t: t.numel, cap_elems=cap):
            if rank == src:
                flat = torch.cat([t.src.view().reshape(-1) for t in bucket]).to(device=device, dtype=dtype)
                if comm is not None:
                    comm.add(kind, flat.numel() * flat.element_size())
            else:
                flat = torch.empty(sum(t.numel for t in bucket), dtype=dtype, device=device)
            dist.broadcast(flat, src=src)
            offset = 0
            for t in bucket:
                if t.dst is not None:
                    view = t.dst.view()
                    view.copy_(flat[offset : offset + t.numel].view_as(view))
                offset += t.numel
