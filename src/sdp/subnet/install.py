"""Installing a subnetwork: a full plain model made this rank's subnetwork under one mask.

The `Installer` applies the masking mode (`sdp.subnet.modes`: forward masking slices, then moves
only the submodel to the device; backward masking makes held-range views into the full weights,
on the device), prepares the result
(activation checkpointing, compilation), registers the process groups of the mask's holder sets
and finishes the subnetwork for training. It returns an `Installed`: everything the other parts
need of the subnetwork until the next resample. SDP x FSDP (`sdp.subnet.sharded`) registers
its groups and finishes its subnetwork (FSDP2 sharding) its own way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from sdp.subnet.apply import Subnet
from sdp.subnet.groups import HolderGroups
from sdp.subnet.layout import Chunk
from sdp.subnet.mask import Mask
from sdp.subnet.modes import mode_of
from sdp.subnet.plan import SubnetPlan
from sdp.subnet.sync import GradEntry


@dataclass(frozen=True)
class Installed:
    """This rank's subnetwork under one mask."""

    mask: Mask
    subnet: Subnet  # its grad_entries point at `params`, holders as workers
    chunks: list[Chunk]
    entries: list[GradEntry]  # the gradient entries as the sync averages them (holders as ranks)
    # The subnetwork's parameters by name as masking made them (before SDP x FSDP sharded them).
    params: dict[str, nn.Parameter]

    @property
    def model(self) -> nn.Module:
        return self.subnet.model


class Installer:
    """Makes full plain models this rank's subnetworks, and owns the holder sets' process groups."""

    outer = True  # columns cut among holder sets kept outermost (sdp.subnet.layout.outer_dims)

    def __init__(
        self,
        plan: SubnetPlan,
        *,
        rank: int,
        device: torch.device,
        prepare: Callable[[nn.Module], object] | None = None,
    ):
        """`prepare` is applied to every subnetwork (activation checkpointing, compilation)."""
        self.plan, self.rank, self.device, self.prepare = plan, rank, device, prepare
        self.worker = plan.worker_of(rank)
        self.groups = HolderGroups([], world_size=torch.distributed.get_world_size())

    def install(self, model: nn.Module, mask: Mask) -> Installed:
        """Make `model` (a full plain model, current weights) this rank's subnetwork under `mask`
        (collective: the groups of new holder sets are created)."""
        mode = mode_of(self.plan.cfg.name)
        subnet, chunks = mode.install(model, self.plan, mask, worker=self.worker, device=self.device, outer=self.outer)
        if self.prepare is not None:
            self.prepare(subnet.model)
        self.register(mask.holder_sets())
        params = dict(subnet.model.named_parameters())
        return Installed(mask, subnet, chunks, self.finish(subnet), params)

    def register(self, holder_sets) -> None:
        """Process groups for holder sets of workers (collective: every rank, same sets)."""
        self.groups.add(holder_sets)

    def finish(self, subnet: Subnet) -> list[GradEntry]:
        """Last touches to a new subnetwork; returns its gradient entries (holders as ranks)."""
        return subnet.grad_entries
