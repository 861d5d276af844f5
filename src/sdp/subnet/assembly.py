"""The plain model from this rank's subnetwork, current on every rank (collective).

Forward masking assembles it: each unit from one of its holders, the shared tensors from this
rank. Backward masking has every weight already (the refresh keeps the non-held ranges current);
only the held units' buffers (BatchNorm statistics) come from their holders. What evaluation,
`model.pt`, checkpoints and resampling read.

Chunk holders are workers; under SDP x FSDP (F > 1) a worker's tensors are first gathered
from its F ranks and its shard-0 rank sends for it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from sdp.dist import is_dtensor
from sdp.metrics.comm import CommCounter
from sdp.subnet import resolved_scale
from sdp.subnet.apply import backward_buffer_sync, fold_eval_scaling, forward_assembly, named_tensors
from sdp.subnet.install import Installed
from sdp.subnet.modes import mode_of
from sdp.subnet.plan import SubnetPlan
from sdp.subnet.sync import Transfer, broadcast_from_holders


def rank_space(transfers: list[Transfer], *, fsdp_degree: int) -> list[Transfer]:
    """Transfers whose sources are workers, with ranks as sources: a worker's shard-0 rank sends
    for it (every rank of the worker has the gathered values)."""
    if fsdp_degree == 1:
        return transfers
    return [Transfer(t.source * fsdp_degree, t.numel, t.src, t.dst) for t in transfers]


def unsharded_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The subnetwork's tensors by name, unsharded (SDP x FSDP: collective within the worker, its
    F ranks gather every shard in the same order)."""
    return {n: t.full_tensor() if is_dtensor(t) else t for n, t in named_tensors(model).items()}


class Assembler:
    """The full plain model, with the current weights and buffers, from this rank's subnetwork."""

    def __init__(
        self,
        plan: SubnetPlan,
        *,
        rank: int,
        comm: CommCounter,
        bucket_cap_mb: float,
        device: torch.device,
        make_plain: Callable[[], nn.Module],
    ):
        """`make_plain` builds a full plain model on `device`, which assembly overwrites."""
        self.plan, self.rank, self.comm, self.bucket_cap_mb, self.device = plan, rank, comm, bucket_cap_mb, device
        self.make_plain = make_plain
        self.worker = plan.worker_of(rank)

    def rank_space(self, transfers: list[Transfer]) -> list[Transfer]:
        return rank_space(transfers, fsdp_degree=self.plan.fsdp_degree)

    def fresh_plain(self) -> nn.Module:
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            return self.make_plain()  # its random init must not move the training RNG streams

    def _broadcast(self, transfers: list[Transfer], *, comm: CommCounter | None, kind: str) -> None:
        broadcast_from_holders(
            transfers, rank=self.rank, comm=comm, kind=kind, bucket_cap_mb=self.bucket_cap_mb, device=self.device
        )

    @torch.no_grad()
    def assemble(self, installed: Installed, *, fold_eval_scale: bool, comm_kind: str | None = None) -> nn.Module:
        """The full plain model, gathered from the holders (forward masking); with
        `fold_eval_scale`, as evaluated (masking.scale=eval_coverage folded into its weights).
        With `comm_kind`, the bytes sent are counted under that kind."""
        spec = self.plan.spec
        full = self.fresh_plain()
        local = unsharded_tensors(installed.model)
        for name in spec.shared_params:
            full.get_parameter(name).copy_(local[name])
        transfers = self.rank_space(forward_assembly(local, full, spec, installed.chunks, rank=self.worker))
        self._broadcast(transfers, comm=self.comm if comm_kind else None, kind=comm_kind or "assembly")
        if fold_eval_scale and resolved_scale(self.plan.cfg) == "eval_coverage":
            fold_eval_scaling(full, spec, installed.mask)
        return full

    def sync_buffers(self, installed: Installed, *, comm: CommCounter | None, kind: str) -> None:
        """Backward masking: every held unit's buffers (BatchNorm statistics) from its holder."""
        transfers = backward_buffer_sync(installed.model, self.plan.spec, installed.chunks, rank=self.rank)
        self._broadcast(transfers, comm=comm, kind=kind)

    @torch.no_grad()
    def full_parameters(self, installed: Installed) -> dict[str, torch.Tensor]:
        """Every parameter of the plain model by its plain name (collective; backward masking's
        refresh must have finished): the mode's."""
        return mode_of(self.plan.cfg.name).full_parameters(self, installed)

    @torch.no_grad()
    def current_plain_model(self, installed: Installed, *, counted: bool = True) -> nn.Module:
        """A plain model with the current weights and buffers, on every rank (collective); the
        bytes sent are counted as resample traffic when `counted`."""
        return mode_of(self.plan.cfg.name).current_plain_model(self, installed, counted=counted)

    def eval_model(self, installed: Installed) -> nn.Module:
        """The model evaluation runs (collective): backward masking's own (its held buffers
        synced), forward masking's assembled one."""
        return mode_of(self.plan.cfg.name).eval_model(self, installed)

    def plain_state_dict(self, installed: Installed, eval_model: nn.Module) -> dict[str, torch.Tensor]:
        """The state dict of `eval_model` (from `eval_model`) under the plain model's names."""
        return mode_of(self.plan.cfg.name).plain_state_dict(self, installed, eval_model)
