"""Where each unit's values live: chunks of tensors with their holder sets.

A *chunk* here is the part of one tensor that one mask chunk of one unit group
owns: a few contiguous ranges along the sliced dimension (one range for FFN
units and channels, three for a Swin head's q/k/v rows), or the whole tensor
for a block unit. Every chunk has one holder set. Gradient sync, weight
refresh and assembly all walk these chunks, grouped by holder set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sdp.subnet.mask import Mask
from sdp.subnet.units import UnitSpec

Range = tuple[int, int]  # (start, length) along the sliced dimension


@dataclass(frozen=True)
class Chunk:
    tensor: str  # parameter or buffer name in the plain model
    dim: int | None  # None: the whole tensor (block unit)
    ranges: tuple[Range, ...]  # full-model coordinates, sorted; () for a whole tensor
    holders: tuple[int, ...]
    source: int  # the holder that sends this chunk to the others
    is_buffer: bool
    group: int  # index of the unit group in the spec
    units: int  # how many units of the group the chunk carries

    def numel(self, shape: torch.Size) -> int:
        if self.dim is None:
            return shape.numel()
        return shape.numel() // shape[self.dim] * sum(n for _, n in self.ranges)


def outer_dims(chunks: list[Chunk]) -> dict[str, int]:
    """The trained tensors cut along a dimension d > 0 among more than one holder set, with d:
    those that `outer_layout` keeps (the same on every rank: it depends on the mask alone).

    Their held pieces are columns (o_proj's and down_proj's heads and neurons, conv2's input
    channels, Swin's proj, fc2 and relative-position table): in a row-major tensor each is a
    strided view, which CUDA's fused optimizer refuses and whose gradient packs, averages and
    refreshes element by element. With d outermost each is one dense block. A tensor that one
    holder set holds whole keeps its layout (C = 1 is DDP bit for bit)."""
    sets: dict[str, set[tuple[int, ...]]] = {}
    dims: dict[str, int] = {}
    for ch in chunks:
        if not ch.is_buffer and ch.dim is not None and ch.dim > 0:
            sets.setdefault(ch.tensor, set()).add(ch.holders)
            dims[ch.tensor] = ch.dim
    return {name: dims[name] for name, holder_sets in sets.items() if len(holder_sets) > 1}


def outer_layout(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`t`'s values in a new tensor of the same shape with dimension `dim` outermost in memory (a
    Linear weight's columns: its transpose, stored contiguous): any range along `dim` is one
    dense block. Torch's kernels take it as they take a transposed view (a matrix product reads
    it in place; autograd gives its gradient the same layout)."""
    return t.movedim(dim, 0).contiguous().movedim(0, dim)


def to_ranges(positions: torch.Tensor) -> tuple[Range, ...]:
    """Sorted positions as maximal contiguous (start, length) runs."""
    pos = sorted(positions.tolist())
    runs: list[list[int]] = []
    for p in pos:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return tuple((s, n) for s, n in runs)


def build_chunks(spec: UnitSpec, mask: Mask) -> list[Chunk]:
    """Every (tensor, mask chunk) pair of the model, in a deterministic order."""
    chunks = []
    for g, group in enumerate(spec.groups):
        chunk_of = torch.from_numpy(mask.chunk_of[g])
        for c, holders in enumerate(mask.chunk_holders[g]):
            units = torch.nonzero(chunk_of == c).flatten()
            if units.numel() == 0:
                continue
            for s in group.slices:
                ranges = () if s.dim is None else to_ranges(s.unit_positions(units))
                source = mask.chunk_source[g][c]
                chunks.append(Chunk(s.name, s.dim, ranges, holders, source, s.is_buffer, g, units.numel()))
    return chunks


@dataclass(frozen=True)
class LocalTensor:
    """A sliced tensor as one rank holds it: its held chunks, concatenated in position order."""

    name: str
    dim: int | None
    chunks: tuple[Chunk, ...]  # held chunks
    # For each held chunk, its ranges as (full_start, local_start, length).
    placements: tuple[tuple[tuple[int, int, int], ...], ...]
    full_size: int  # size of the full tensor along dim (0 for whole tensors)

    @property
    def local_size(self) -> int:
        return sum(n for per_chunk in self.placements for _, _, n in per_chunk)

    def held_positions(self) -> torch.Tensor:
        """Full-model positions along dim of the local tensor's entries, in local order."""
        starts = sorted((f, n) for per_chunk in self.placements for f, _, n in per_chunk)
        return torch.cat([torch.arange(f, f + n) for f, n in starts]) if starts else torch.zeros(0, dtype=torch.long)

    @property
    def whole(self) -> bool:
        """True when this rank holds every position (nothing to slice)."""
        return self.dim is None or self.local_size == self.full_size


def local_tensors(chunks: list[Chunk], *, rank: int, shapes: dict[str, torch.Size]) -> dict[str, LocalTensor]:
    """The held part of every unit tensor on `rank` (an empty one when it holds none)."""
    by_tensor: dict[str, list[Chunk]] = {}
    for ch in chunks:
        by_tensor.setdefault(ch.tensor, []).append(ch)
    out = {}
    for name, all_chunks in by_tensor.items():
        dim = all_chunks[0].dim
        held = [ch for ch in all_chunks if rank in ch.holders]
        full_size = 0 if dim is None else shapes[name][dim]
        # Local order is full-position order over all held ranges (keeps q|k|v layouts intact).
        flat = sorted((start, n, i) for i, ch in enumerate(held) for start, n in ch.ranges)
        local_start, per_chunk = 0, [[] for _ in held]
        for start, n, i in flat:
            per_chunk[i].append((start, local_start, n))
            local_start += n
        out[name] = LocalTensor(name, dim, tuple(held), tuple(tuple(p) for p in per_chunk), full_size)
    return out
