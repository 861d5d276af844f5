"""What the outer loop needs of a strategy: the tensors this rank trains, each piece's holders,
and how a synced value reaches the ranks that do not hold it; and the strategies that step
alone between syncs.

Under DDP every rank holds every tensor, and the holders of each are the world. Under SDP a
piece's holders are its unit's (the gradient entries of `sdp.subnet`, whose process groups
exist already); backward masking's non-held ranges, which no inner step touches, receive the
new values from their holders after each sync (the weight refresh's transfers, of the synced
tensors only: the others' holders are mid-window).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from sdp.metrics.comm import CommCounter
from sdp.models import blocks
from sdp.parallel import Strategy, host
from sdp.parallel.ddp import DDPStrategy
from sdp.subnet.groups import HolderGroups
from sdp.subnet.plan import block_index
from sdp.subnet.resample import place_state
from sdp.subnet.strategy import SDPStrategy
from sdp.subnet.sync import GradEntry, Piece, broadcast_from_holders


class LocalDDPStrategy(DDPStrategy):
    """DDP's strategy without its per-step gradient all-reduce: every rank holds the whole model
    and steps alone (DistributedDataParallel is not applied); the outer loop averages."""

    def wrap(self, model: nn.Module, cfg, *, device: torch.device, comm: CommCounter) -> nn.Module:
        return model

    def no_sync(self):
        return contextlib.nullcontext()


@dataclass
class OuterView:
    """This rank's trained tensors as the outer loop sees them.

    `trainable`: the tensors the inner optimizer steps; `entries`: their pieces, each with its
    holders (ranks) and where it sits in the plain model; `group(holders)`: the process group of a
    holder set (None: a single holder); `position` and `block_of`: a plain tensor's place in the
    model and its block (-1: none); `refresh(chosen)`: send the synced values of the plain tensors
    whose name is `chosen` to the ranks that keep a copy without holding them (collective); `gather(state)`:
    per-tensor state ({tensor: {key: like the tensor}}) in plain coordinates on the host of every
    rank (collective); `place(full)`: the inverse, cut for this rank's tensors."""

    trainable: list[nn.Parameter]
    entries: list[GradEntry]
    group: Callable[[tuple[int, ...]], object]
    position: dict[str, int]
    block_of: dict[str, int]
    refresh: Callable[[Callable[[str], bool]], None]
    gather: Callable[[dict], dict[str, dict[str, torch.Tensor]]]
    place: Callable[[dict], dict]


def view_of(strategy: Strategy, *, family: str, comm: CommCounter, bucket_cap_mb: float) -> OuterView:
    """The outer loop's view of `strategy` (an SDP strategy, or DDP's stepping alone)."""
    if isinstance(strategy, SDPStrategy):
        return _sdp_view(strategy, comm=comm, bucket_cap_mb=bucket_cap_mb)
    if isinstance(strategy, DDPStrategy):
        return _ddp_view(strategy, family=family)
    raise TypeError(f"the outer loop runs over DDP or SDP, not {type(strategy).__name__}")


def _ddp_view(strategy: DDPStrategy, *, family: str) -> OuterView:
    model, world = strategy.plain, tuple(range(dist.get_world_size()))
    named = dict(model.named_parameters())
    trainable = [p for p in named.values() if p.requires_grad]
    entries = [GradEntry(world, "grad_sync", Piece(p, None), n) for n, p in named.items() if p.requires_grad]
    groups = HolderGroups([world], world_size=len(world))
    block_of = block_index(named, [path for path, _ in blocks(model, family=family)])
    name_of = {id(p): n for n, p in named.items()}

    def gather(state: dict) -> dict:  # every rank holds every tensor: its own values are the plain ones
        out: dict[str, dict[str, torch.Tensor]] = {}
        for p, per_key in state.items():
            for key, t in per_key.items():
                out.setdefault(key, {})[name_of[id(p)]] = host(t)
        return out

    def place(full: dict) -> dict:
        return {p: {key: per_name[name_of[id(p)]].clone() for key, per_name in full.items()} for p in trainable}

    return OuterView(
        trainable,
        entries,
        groups.get,
        {n: i for i, n in enumerate(named)},
        block_of,
        refresh=lambda chosen_name: None,
        gather=gather,
        place=place,
    )


def _sdp_view(strategy: SDPStrategy, *, comm: CommCounter, bucket_cap_mb: float) -> OuterView:
    plan, installed = strategy.plan, strategy.installed
    trainable = list(installed.subnet.trainable)
    transfers = strategy.step_sync.refresh.transfers  # backward masking's; none under forward masking

    def refresh(chosen_name: Callable[[str], bool]) -> None:
        # Every rank holds the same list and chooses by plain name: the same cut everywhere.
        chosen = [t for t in transfers if chosen_name(t.name)]
        if chosen:
            broadcast_from_holders(
                chosen,
                rank=strategy.rank,
                comm=comm,
                kind="weight_refresh",
                bucket_cap_mb=bucket_cap_mb,
                device=strategy.device,
            )

    def gather(state: dict) -> dict:
        # The optimizer's gathering, over a view whose state is the outer loop's.
        view = SimpleNamespace(param_groups=[{"params": trainable}], state=state)
        full, _ = strategy.mover.gather(installed, view, comm=None)
        return full

    def place(full: dict) -> dict:
        return place_state(full, {}, installed.subnet.grad_entries, trainable)

    return OuterView(
        trainable,
        list(installed.entries),
        strategy.installer.groups.get,
        plan.position,
        plan.block_of,
        refresh=refresh,
        gather=gather,
        place=place,
    )
