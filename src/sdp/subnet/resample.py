"""Moving optimizer state when the mask is resampled (`masking.resample_every`).

A unit's optimizer state is the same on all of its holders (they apply the
same averaged gradients), so, like its weights, it has one value in plain
model coordinates. At a resample every rank gathers each unit's state from
the unit's old sending holder into full-size tensors on the host, builds its
new subnetwork, and cuts the state of its new held pieces out of them.
Shared parameters keep their state where it is (it is identical everywhere).
The full-size copies live in host memory, and only one bucket at a time is
on the device; a resample is rare (every N steps), so it favours simplicity
over the last byte of traffic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from sdp.metrics.comm import CommCounter
from sdp.subnet.layout import Chunk
from sdp.subnet.sync import GradEntry, Piece, Transfer, broadcast_from_holders

HOST = torch.device("cpu")


def _full_length(e: GradEntry) -> int:
    """How many positions along e.full_dim the entry covers in the plain model."""
    return e.piece.tensor.shape[e.full_dim] if e.piece.dim is None else e.piece.length


def _plain_region(full: torch.Tensor, e: GradEntry) -> torch.Tensor:
    """The part of a plain-model tensor that entry `e` covers."""
    return full if e.full_dim is None else full.narrow(e.full_dim, e.full_start, _full_length(e))


def _covering(entries: list[GradEntry], ch: Chunk, start: int, n: int) -> GradEntry:
    """The trainable piece that holds plain positions [start, start + n) of chunk `ch`."""
    for e in entries:
        if ch.dim is None and e.full_dim is None:
            return e
        if e.full_dim == ch.dim and e.full_start <= start and start + n <= e.full_start + _full_length(e):
            return e
    raise RuntimeError(f"no held piece of {ch.tensor} covers positions {start}..{start + n}")


def _local_piece(e: GradEntry, tensor: torch.Tensor, ch: Chunk, start: int, n: int) -> Piece:
    """Plain positions [start, start + n) of chunk `ch` in `tensor`, shaped like e's parameter."""
    if ch.dim is None:
        return Piece(tensor, None)
    local_start = (0 if e.piece.dim is None else e.piece.start) + start - e.full_start
    return Piece(tensor, ch.dim, local_start, n)


def _state_keys(optimizer: torch.optim.Optimizer) -> tuple[list[str], dict[str, torch.Tensor]]:
    """The per-element state keys (tensors shaped like their parameter) and the scalar ones
    (Adam's step count, equal for every parameter: all of them are stepped every step)."""
    params = optimizer.param_groups[0]["params"]
    state = optimizer.state.get(params[0], {})
    per_element = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == params[0].shape)
    scalars = {k: v.clone() for k, v in state.items() if k not in per_element and torch.is_tensor(v)}
    return per_element, scalars


@torch.no_grad()
def gather_state(
    optimizer: torch.optim.Optimizer,
    entries: list[GradEntry],
    chunks: list[Chunk],
    *,
    shapes: Mapping[str, torch.Size],
    rank: int,
    comm: CommCounter,
    bucket_cap_mb: float,
    device: torch.device,
    worker: int | None = None,
    rank_space: Callable[[list[Transfer]], list[Transfer]] | None = None,
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Every trainable tensor's optimizer state in plain coordinates, on the host of every rank.

    Chunk holders are workers: this rank is worker `worker` (default: `rank`), and
    `rank_space` maps transfers from workers to the ranks that send (SDP x FSDP).
    Returns ({state key: {plain name: full tensor}}, scalar state). Collective.
    """
    worker = rank if worker is None else worker
    if len(optimizer.param_groups) != 1:
        raise ValueError("mask resampling supports optimizers with one parameter group")
    keys, scalars = _state_keys(optimizer)
    by_name: dict[str, list[GradEntry]] = {}
    for e in entries:
        by_name.setdefault(e.name, []).append(e)
    trained = {ch.tensor for ch in chunks if not ch.is_buffer}
    full: dict[str, dict[str, torch.Tensor]] = {k: {} for k in keys}
    for name in sorted(trained | set(by_name)):
        for key in keys:
            full[key][name] = torch.zeros(shapes[name], dtype=torch.float32, device=HOST)
    # Shared parameters: every rank's state is already the full one.
    for name, es in by_name.items():
        if name not in trained:
            for key in keys:
                full[key][name].copy_(optimizer.state[es[0].piece.tensor][key])
    transfers = []
    for ch in chunks:
        if ch.is_buffer:
            continue
        ranges = [(0, 0)] if ch.dim is None else ch.ranges
        row = 0 if ch.dim is None else shapes[ch.tensor].numel() // shapes[ch.tensor][ch.dim]
        for start, n in ranges:
            numel = shapes[ch.tensor].numel() if ch.dim is None else row * n
            for key in keys:
                dst = full[key][ch.tensor]
                dst_piece = Piece(dst, None) if ch.dim is None else Piece(dst, ch.dim, start, n)
                src = None
                if worker == ch.source:
                    e = _covering(by_name[ch.tensor], ch, start, n)
                    src = _local_piece(e, optimizer.state[e.piece.tensor][key], ch, start, n)
                transfers.append(Transfer(ch.source, numel, src, dst_piece))
    if rank_space is not None:
        transfers = rank_space(transfers)
    broadcast_from_holders(transfers, rank=rank, comm=comm, kind="resample", bucket_cap_mb=bucket_cap_mb, device=device)
    return full, scalars


@torch.no_grad()
def place_state(
    full: dict[str, dict[str, torch.Tensor]],
    scalars: dict[str, torch.Tensor],
    entries: list[GradEntry],
    trainable: list[torch.nn.Parameter],
) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
    """The optimizer state of a new subnetwork's trainable tensors, cut from the gathered full state."""
    state: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    for e in entries:
        p = e.piece.tensor
        st = state.setdefault(p, {k: v.clone() for k, v in scalars.items()})
        for key, per_name in full.items():
            if key not in st:
                st[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            e.piece.view(st[key]).copy_(_plain_region(per_name[e.name], e))
    missing = [p for p in trainable if p not in state]
    if missing:
        raise RuntimeError(f"{len(missing)} trainable tensors are in no synced piece; cannot place their state")
    return state
