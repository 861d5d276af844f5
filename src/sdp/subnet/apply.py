"""Apply a mask to a plain model on one rank: forward or backward masking.

Both produce a `Subnet`: the local model the trainer runs, the tensors this
rank trains, the pieces whose gradients are averaged with which holders, and
how unit values travel from holders to everyone (weight refresh under
backward masking, assembly of the full model for evaluation).

Forward masking (N-SDP / B-SDP): the rank's model is physically smaller.
Held neurons are copied into new, smaller tensors (index_select over the held
positions, in position order so q|k|v layouts stay intact); dropped blocks
are replaced by their residual path. Nothing of a non-held unit is allocated.

Backward masking (N_b-SDP / B_b-SDP): the rank keeps every weight for the full
forward, but only held slices are trainable. A sliced weight's held ranges
become Parameters that *view* the full tensor (no copy), so gradients and
optimizer state exist only for them and an optimizer step writes straight into
the weights the next forward reads. Non-held ranges are refreshed from their
holders after every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from sdp.errors import ConfigError
from sdp.subnet.held import install_held
from sdp.subnet.layout import (
    Chunk,
    LocalTensor,
    build_chunks,
    local_tensors,
    outer_dims,
    outer_layout,
)
from sdp.subnet.mask import Mask
from sdp.subnet.sync import GradEntry, Piece, Transfer
from sdp.subnet.units import UnitSpec


@dataclass
class Subnet:
    model: nn.Module
    trainable: list[nn.Parameter]
    grad_entries: list[GradEntry]
    # Tensors that hold weights but are not Parameters (backward masking's full weights).
    weight_tensors: list[torch.Tensor] = field(default_factory=list)
    # Backward masking: every step, non-held unit ranges come from their holders.
    refresh: list[Transfer] = field(default_factory=list)


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return model.get_submodule(path) if path else model, attr


def _relayout(model: nn.Module, name: str, dim: int) -> nn.Parameter:
    """Replace parameter `name` by its values kept with `dim` outermost (`outer_layout`)."""
    owner, attr = _owner(model, name)
    old = getattr(owner, attr)
    new = nn.Parameter(outer_layout(old.detach(), dim), requires_grad=old.requires_grad)
    setattr(owner, attr, new)
    return new


def _shared_entries(model: nn.Module, spec: UnitSpec, world_size: int) -> list[GradEntry]:
    everyone = tuple(range(world_size))
    names = set(spec.shared_params)
    return [GradEntry(everyone, "shared_sync", Piece(p, None), n) for n, p in model.named_parameters() if n in names]


def _unit_entries(lt: LocalTensor, tensor: torch.Tensor) -> list[GradEntry]:
    """One entry per held range of a unit tensor held as `tensor` (local coordinates)."""
    entries = []
    for ch, placement in zip(lt.chunks, lt.placements, strict=True):
        if lt.dim is None:
            entries.append(GradEntry(ch.holders, "grad_sync", Piece(tensor, None), lt.name))
        for full_start, local_start, n in placement:
            piece = Piece(tensor, lt.dim, local_start, n)
            entries.append(GradEntry(ch.holders, "grad_sync", piece, lt.name, lt.dim, full_start))
    return entries


def _coalesce(entries: list[GradEntry]) -> list[GradEntry]:
    """Merge a tensor's pieces that are adjacent (locally and in the plain model) and share holders."""
    out: list[GradEntry] = []
    # Sorted by plain-model name: every rank must fill its buckets in the same order.
    for e in sorted(entries, key=lambda e: (e.name, e.full_start)):
        last = out[-1] if out else None
        if (
            last is not None
            and e.piece.dim is not None
            and last.piece.tensor is e.piece.tensor
            and last.holders == e.holders
            and last.piece.start + last.piece.length == e.piece.start
            and last.full_start + last.piece.length == e.full_start
        ):
            piece = Piece(e.piece.tensor, e.piece.dim, last.piece.start, last.piece.length + e.piece.length)
            out[-1] = GradEntry(last.holders, last.kind, piece, last.name, last.full_dim, last.full_start)
        else:
            out.append(e)
    return out


# --------------------------------------------------------------------- forward masking


def add_scale_hook(module: nn.Module, factor: float) -> None:
    """Multiply the module's output by `factor` in training (forward masking's inverse coverage)."""

    def hook(mod, args, output):
        return output * factor if mod.training else output

    module.register_forward_hook(hook)


def apply_forward_masking(
    model: nn.Module, spec: UnitSpec, mask: Mask, *, rank: int, scale: str, outer: bool = True
) -> tuple[Subnet, list[Chunk]]:
    """Turn `model` (a full plain model) into this rank's physical submodel, in place. With
    `outer`, a tensor cut along a dimension d > 0 keeps d outermost (`outer_dims`), so its held
    pieces are dense; SDP x FSDP does not (FSDP takes contiguous parameters, and shards them)."""
    shapes = {n: t.shape for n, t in _named_tensors(model)}
    chunks = build_chunks(spec, mask)
    locals_ = local_tensors(chunks, rank=rank, shapes=shapes)
    for g, group in enumerate(spec.groups):
        held = mask.held_units(rank, g)
        if group.kind == "block":
            if held.size == 0:
                parent, attr = _owner(model, group.name)
                setattr(parent, attr, group.skip(model.get_submodule(group.name)))
            elif scale == "inverse_coverage":  # K / the block's holders: 1 / the share of workers that run it
                for out in group.outputs:
                    add_scale_hook(model.get_submodule(out), mask.num_workers / len(mask.unit_holders(g)[0]))
            continue
        if held.size == 0:
            uniform = mask.holders is not None  # else masking.capacity gave each worker its share
            raise ConfigError(
                "masking.coverage" if uniform else f"masking.capacity[{rank}]",
                mask.capacity[rank],
                f"leaves worker {rank} no unit of {group.name} ({group.num_units} {group.kind} units over "
                f"{mask.num_workers} workers); raise {'the coverage' if uniform else 'its capacity'} or use "
                "masking.granularity=block",
            )
        for attr_path in group.count_attrs:
            owner, attr = _owner(model, attr_path)
            setattr(owner, attr, int(held.size))
        if scale == "inverse_coverage" and held.size < group.num_units:
            for out in group.outputs:
                add_scale_hook(model.get_submodule(out), group.num_units / held.size)
    for lt in locals_.values():
        if lt.dim is not None and not lt.whole:
            _slice_tensor(model, lt)
    for name, dim in outer_dims(chunks).items() if outer else ():
        _relayout(model, name, dim)

    entries = _shared_entries(model, spec, mask.num_workers)
    tensors = dict(_named_tensors(model))
    for lt in locals_.values():
        if lt.name in tensors and isinstance(tensors[lt.name], nn.Parameter):  # not a buffer or a dropped block
            entries += _unit_entries(lt, tensors[lt.name])
    trainable = list(model.parameters())
    return Subnet(model=model, trainable=trainable, grad_entries=_coalesce(entries)), chunks


def _named_tensors(model: nn.Module):
    yield from model.named_parameters()
    yield from ((n, b) for n, b in model.named_buffers() if b is not None)


def _slice_tensor(model: nn.Module, lt: LocalTensor) -> None:
    """Replace a full tensor by its held positions along lt.dim (a new, smaller tensor)."""
    owner, attr = _owner(model, lt.name)
    full = getattr(owner, attr)
    held = full.detach().index_select(lt.dim, lt.held_positions().to(full.device))  # a new, smaller tensor
    if isinstance(full, nn.Parameter):
        setattr(owner, attr, nn.Parameter(held, requires_grad=full.requires_grad))
    else:
        owner.register_buffer(attr, held, persistent=attr not in owner._non_persistent_buffers_set)


@torch.no_grad()
def fold_eval_scaling(full: nn.Module, spec: UnitSpec, mask: Mask) -> None:
    """Stochastic-depth style evaluation: every unit site's output x the share of workers that
    trained its units (the mean holders of the group's units / K: C for a uniform mask), folded
    into the weight and bias of the site's affine output module, so the plain model computes it."""
    factor = {}
    for g, group in enumerate(spec.groups):
        share = float(mask.holder_counts(g).sum()) / group.num_units / mask.num_workers
        for out in group.outputs:
            if factor.setdefault(out, share) != share:
                raise ValueError(f"{out} is the output of unit groups trained by different shares of the workers")
    for name in sorted(factor):
        module = full.get_submodule(name)
        module.weight.mul_(factor[name])
        if module.bias is not None:
            module.bias.mul_(factor[name])


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and (non-None) buffers by name."""
    return dict(_named_tensors(model))


def forward_assembly(
    local_t: dict[str, torch.Tensor], full: nn.Module, spec: UnitSpec, chunks: list[Chunk], *, rank: int
) -> list[Transfer]:
    """Transfers that fill `full` (a fresh plain model) from the holders' submodels, given
    this worker's (`rank`'s) submodel tensors by name, unsharded.

    Shared parameters are the same on every rank and are copied locally by the
    caller; shared float buffers (BatchNorm statistics) come from rank 0, as
    DDP's do; unit tensors come from their first holder.
    """
    full_t = dict(_named_tensors(full))
    shapes = {n: t.shape for n, t in full_t.items()}
    placements = {n: lt for n, lt in local_tensors(chunks, rank=rank, shapes=shapes).items()}
    transfers = []
    for ch in chunks:
        if ch.dim is None:
            src = Piece(local_t[ch.tensor], None) if rank == ch.source else None
            transfers.append(Transfer(ch.source, shapes[ch.tensor].numel(), src, Piece(full_t[ch.tensor], None)))
            continue
        mine = placements[ch.tensor]
        local_of = {}
        if rank == ch.source:
            i = mine.chunks.index(ch)
            local_of = {f: s for f, s, _ in mine.placements[i]}
        row = shapes[ch.tensor].numel() // shapes[ch.tensor][ch.dim]
        for start, n in ch.ranges:
            src = Piece(local_t[ch.tensor], ch.dim, local_of[start], n) if local_of else None
            transfers.append(Transfer(ch.source, row * n, src, Piece(full_t[ch.tensor], ch.dim, start, n)))
    for name in spec.shared_buffers:
        if name in local_t and full_t[name].is_floating_point() and not _under_block(name, spec):
            src = Piece(local_t[name], None) if rank == 0 else None
            transfers.append(Transfer(0, full_t[name].numel(), src, Piece(full_t[name], None)))
    return transfers


def _under_block(name: str, spec: UnitSpec) -> bool:
    """True for tensors inside a block unit's module (absent on ranks that dropped the block)."""
    return any(g.kind == "block" and name.startswith(g.name + ".") for g in spec.groups)


# -------------------------------------------------------------------- backward masking


def apply_backward_masking(model: nn.Module, spec: UnitSpec, mask: Mask, *, rank: int) -> tuple[Subnet, list[Chunk]]:
    """Keep the full model for the forward; make only this rank's unit ranges trainable: views of
    the full weight (dense: a weight cut along a dimension d > 0 keeps d outermost on every rank,
    `outer_dims`)."""
    shapes = {n: t.shape for n, t in _named_tensors(model)}
    chunks = build_chunks(spec, mask)
    outer = outer_dims(chunks)
    params = dict(model.named_parameters())
    entries = _shared_entries(model, spec, mask.num_workers)
    weight_tensors, full_of = [], {}
    for lt in local_tensors(chunks, rank=rank, shapes=shapes).values():
        if lt.name not in params:
            continue  # buffers are not trained
        p = _relayout(model, lt.name, outer[lt.name]) if lt.name in outer else params[lt.name]
        full_of[lt.name] = p
        if not lt.chunks:
            p.requires_grad_(False)  # needed for the forward, refreshed from holders
            continue
        if lt.whole:
            entries += _unit_entries(lt, p)
            continue
        owner, attr = _owner(model, lt.name)
        full = p.detach()
        weight_tensors.append(full)
        full_of[lt.name] = full
        held = [
            (ch.holders, s, n) for ch, placement in zip(lt.chunks, lt.placements, strict=True) for s, _, n in placement
        ]
        pieces = install_held(owner, attr, full, lt.dim, [(s, n) for _, s, n in held])
        for piece, (holders, start, n) in zip(pieces, held, strict=True):  # its cut dimension first on the wire
            entries.append(GradEntry(holders, "grad_sync", Piece(piece, lt.dim, 0, n), lt.name, lt.dim, start))
    refresh = []
    for ch in chunks:
        if ch.is_buffer:
            continue
        whole = Piece(full_of[ch.tensor], None)
        if ch.dim is None:
            mine = whole if rank == ch.source else None
            dst = None if rank in ch.holders else whole
            refresh.append(Transfer(ch.source, full_of[ch.tensor].numel(), mine, dst, ch.tensor, ch.group))
            continue
        row = shapes[ch.tensor].numel() // shapes[ch.tensor][ch.dim]
        for start, n in ch.ranges:
            piece = Piece(full_of[ch.tensor], ch.dim, start, n)
            src, dst = piece if rank == ch.source else None, None if rank in ch.holders else piece
            refresh.append(Transfer(ch.source, row * n, src, dst, ch.tensor, ch.group))
    trainable = [p for p in model.parameters() if p.requires_grad]
    subnet = Subnet(model, trainable, _coalesce(entries), weight_tensors=weight_tensors, refresh=refresh)
    return subnet, chunks


def backward_buffer_sync(model: nn.Module, spec: UnitSpec, chunks: list[Chunk], *, rank: int) -> list[Transfer]:
    """Transfers that make every rank's buffers equal before evaluation: unit
    buffers (BatchNorm statistics of held channels) from their first holder,
    shared float buffers from rank 0."""
    tensors = dict(model.named_buffers())
    transfers = []
    for ch in chunks:
        if not ch.is_buffer:
            continue
        t = tensors[ch.tensor]
        if ch.dim is None:
            transfers.append(
                Transfer(ch.source, t.numel(), Piece(t, None) if rank == ch.source else None, Piece(t, None))
            )
            continue
        row = t.numel() // t.shape[ch.dim]
        for start, n in ch.ranges:
            piece = Piece(t, ch.dim, start, n)
            transfers.append(Transfer(ch.source, row * n, piece if rank == ch.source else None, piece))
    for name in spec.shared_buffers:
        t = tensors.get(name)
        if t is not None and t.is_floating_point():
            transfers.append(Transfer(0, t.numel(), Piece(t, None) if rank == 0 else None, Piece(t, None)))
    return transfers
