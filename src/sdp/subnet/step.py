"""A training step's communication under SDP: the lifecycle the trainer drives.

`StepSync` holds the current subnetwork's gradient averaging (`sync.GradSync`) and backward
masking's weight refresh (`refresh.Refresh`), and runs them at the trainer's calls: `no_sync`
for micro-batches before the last, `after_backward` (wait for the averages), clipping by the
norm of the whole averaged gradient, `after_step` (the refresh). A resample gives it a new
subnetwork (`rebuild`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import torch
from torch import nn

from sdp.metrics.comm import CommCounter
from sdp.subnet.groups import HolderGroups
from sdp.subnet.install import Installed
from sdp.subnet.refresh import Refresh
from sdp.subnet.sync import GradSync


def scale_grads(trainable: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients of `trainable`, whose norm is `norm`, to at most `max_norm`."""
    torch.nn.utils.clip_grads_with_norm_(trainable, max_norm, norm.float())


class StepSync:
    """Gradient averaging among holders and the weight refresh, step by step (collective)."""

    def __init__(
        self,
        *,
        groups: HolderGroups,
        comm: CommCounter,
        bucket_cap_mb: float,
        position: Mapping[str, int],
        block: Mapping[str, int],
        rank: int,
        overlap: bool,
        refresh: Refresh,
        scale: Callable[[list[nn.Parameter], float, torch.Tensor], None] = scale_grads,
        local: bool = False,
    ):
        """`position` and `block`: see `GradSync`; `overlap` (parallelism.overlap_comm) overlaps
        the averaging with the backward; `scale`: how clipping scales the gradients (SDP x FSDP:
        each rank its own shards). `local`: every step is this rank's alone (an outer loop,
        `sdp.outer`, averages every H steps): no gradient averaging, no weight refresh, and
        clipping by the norm of this rank's own gradient."""
        self.groups, self.comm, self.bucket_cap_mb, self.rank = groups, comm, bucket_cap_mb, rank
        self.position, self.block, self.overlap = position, block, overlap
        self.refresh, self.scale, self.local = refresh, scale, local
        self.grads: GradSync | None = None
        self.trainable: list[nn.Parameter] = []
        self.trace: list | None = None

    def rebuild(self, installed: Installed, *, wait_at: Callable[[str], str] | None = None) -> None:
        """Synchronise this new subnetwork from now on (the last one's hooks are removed);
        `wait_at`: see `WeightRefresh`."""
        if self.grads is not None:
            self.grads.remove_hooks()
        self.grads = GradSync(
            installed.entries,
            groups=self.groups,
            comm=self.comm,
            bucket_cap_mb=self.bucket_cap_mb,
            position=self.position,
            block=self.block,
            overlap=self.overlap,
        )
        self.grads.active = not self.local  # local steps: its hooks launch nothing
        self.trainable = installed.subnet.trainable
        self.refresh.rebuild(installed.subnet.refresh, installed.model, wait_at=wait_at)
        self.trace_collectives(self.trace)

    def trace_collectives(self, trace: list | None) -> None:
        """Record every gradient all-reduce and weight-refresh broadcast this rank issues, in
        issue order, into `trace` (None: stop), as (holder set or "world", kind, bucket)."""
        self.trace = trace
        self.grads.trace = trace
        self.refresh.trace_collectives(trace)

    @contextlib.contextmanager
    def no_sync(self):
        if self.local:
            yield
            return
        self.grads.active = False  # gradients accumulate; the hooks launch nothing
        try:
            yield
        finally:
            self.grads.active = True

    def after_backward(self) -> None:
        if self.local:
            return
        self.comm.need_pending(("grad_reduce_scatter",))  # SDP x FSDP: FSDP's, waited for in backward()
        self.refresh.settle()  # the forward waited for every piece it read; nothing is left
        with self.comm.waiting():
            self.grads()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        if self.local:
            return torch.nn.utils.clip_grad_norm_(self.trainable, max_norm, foreach=True)  # as DDPStrategy's
        norm = self.grads.global_norm(rank=self.rank)
        self.scale(self.trainable, max_norm, norm)
        return norm

    def after_step(self) -> None:
        if not self.local:
            self.refresh.after_step()

    def settle(self) -> None:
        self.refresh.settle()
