"""Moving trained state between subnetworks: what a resample and a checkpoint share.

Both take the state out of this rank's subnetwork into the plain model's coordinates (the full
model from the `Assembler`, every trained tensor's optimizer state gathered from one holder,
`resample.gather_state`) and cut a subnetwork's pieces back out of it (`resample.place_state`):
a resample into the new mask's subnetwork, a checkpoint into any K's. The optimizer is read
through a view keyed by the tensors of `subnet.grad_entries`; SDP x FSDP's
(`sdp.subnet.sharded`) unshards it first and cuts the placed state into shards.
"""

from __future__ import annotations

import torch
from torch import nn

from sdp.metrics.comm import CommCounter
from sdp.optim import hyperparameters, rebind
from sdp.parallel import PortableState, host
from sdp.subnet.assembly import Assembler
from sdp.subnet.install import Installed
from sdp.subnet.resample import gather_state, place_state


class StateMover:
    """Weights and optimizer state of this rank's subnetwork, out to plain coordinates and back."""

    def __init__(self, assembly: Assembler, *, rank: int, comm: CommCounter, bucket_cap_mb: float, device):
        self.assembly, self.rank, self.comm = assembly, rank, comm
        self.bucket_cap_mb, self.device = bucket_cap_mb, device

    def view(self, installed: Installed, optimizer: torch.optim.Optimizer):
        """The optimizer as `gather_state` reads it: state keyed by the tensors of subnet.grad_entries."""
        return optimizer

    def gather(self, installed: Installed, optimizer: torch.optim.Optimizer, *, comm: CommCounter | None):
        """Collective: every trained tensor's optimizer state in plain coordinates, on the host
        of every rank (bytes counted as resample traffic in `comm`, when given)."""
        return gather_state(
            self.view(installed, optimizer),
            installed.subnet.grad_entries,
            installed.chunks,
            shapes=self.assembly.plan.shapes,
            rank=self.rank,
            comm=comm,
            bucket_cap_mb=self.bucket_cap_mb,
            device=self.device,
            worker=self.assembly.worker,
            rank_space=self.assembly.rank_space,
        )

    def place(self, installed: Installed, optimizer: torch.optim.Optimizer, state: dict, scalars: dict) -> None:
        """Point `optimizer` at the new subnetwork, with its state cut from the gathered full state."""
        subnet = installed.subnet
        rebind(optimizer, subnet.trainable, place_state(state, scalars, subnet.grad_entries, subnet.trainable))

    def portable_state(self, installed: Installed, optimizer: torch.optim.Optimizer) -> PortableState:
        """The trained state in plain coordinates (collective; the refresh must have finished)."""
        # What a resample gathers (the units' state from their holders, the full model), not
        # counted as traffic of the training steps.
        optim, scalars = self.gather(installed, optimizer, comm=None)
        model = {
            n: host(t) for n, t in self.assembly.current_plain_model(installed, counted=False).state_dict().items()
        }
        return PortableState(model, optim, scalars, hyperparameters(optimizer))

    @torch.no_grad()
    def plain_model(self, state: PortableState) -> nn.Module:
        """A full plain model holding the checkpoint's weights and buffers."""
        full = self.assembly.fresh_plain()
        full.load_state_dict(state.model)
        return full
