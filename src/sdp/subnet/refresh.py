"""Backward masking's weight refresh, overlapped with the next forward.

After every optimizer step each rank's non-held weight ranges are stale: their
holders updated them. `WeightRefresh` broadcasts them from their senders in
forward order, asynchronously, and makes the next forward wait only where it
needs them: each module that owns refreshed tensors waits, in a forward
pre-hook, for the buckets carrying them, so the first layers compute while
later ones are still arriving.

Buckets are cut per (site, sender), a site being one unit group (a layer's
attention or MLP, or a whole block), in the order the forward meets the sites,
and every rank issues them in that one order on the world group. They are
issued one site ahead of the forward (the current site and the next), so at
most two sites' broadcast buffers are alive at a time, as FSDP prefetches one
block ahead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from sdp.metrics.comm import CommCounter
from sdp.subnet.sync import Transfer, split_by_size

PREFETCH_SITES = 1  # sites issued ahead of the one the forward is in


@dataclass(frozen=True)
class RefreshBucket:
    site: int  # index of its site in forward order
    source: int
    transfers: tuple[Transfer, ...]
    numel: int


def plan_refresh(
    transfers: list[Transfer], *, position: Mapping[str, int], cap_elems: int
) -> tuple[list[RefreshBucket], dict[str, int]]:
    """The broadcast buckets in issue order, and each owner module's site (by module path).

    `position` is a plain-model tensor's place in the plain model; a site's place in the
    forward is that of its first tensor. Every rank makes the same list."""
    first: dict[int, int] = {}
    for t in transfers:
        first[t.site] = min(first.get(t.site, position[t.name]), position[t.name])
    order = {site: i for i, site in enumerate(sorted(first, key=lambda s: (first[s], s)))}
    by_key: dict[tuple[int, int], list[Transfer]] = {}
    for t in transfers:  # a stable grouping: the transfers' own order is the same on every rank
        by_key.setdefault((order[t.site], t.source), []).append(t)
    buckets = []
    for (site, source), members in sorted(by_key.items()):
        for part in split_by_size(members, numel=lambda t: t.numel, cap_elems=cap_elems):
            buckets.append(RefreshBucket(site, source, tuple(part), sum(t.numel for t in part)))
    owners = {t.name.rpartition(".")[0]: order[t.site] for t in transfers}
    return buckets, owners


class WeightRefresh:
    """Non-held weight ranges from their senders, overlapped with the next forward (collective).

    `start()` after the optimizer step issues the first sites' broadcasts; the forward
    pre-hooks issue the rest one site ahead and wait for their own; `wait_all()` finishes
    everything (before evaluation, checkpoints, a resample). `trace`, when a list, gets
    every broadcast as ("world", "weight_refresh", bucket index) in issue order.
    """

    def __init__(
        self,
        transfers: list[Transfer],
        *,
        model: nn.Module,
        position: Mapping[str, int],
        rank: int,
        comm: CommCounter,
        bucket_cap_mb: int,
        device: torch.device,
    ):
        self.rank, self.comm, self.device = rank, comm, device
        self.buckets, owners = plan_refresh(transfers, position=position, cap_elems=bucket_cap_mb * 2**20 // 4)
        self.trace: list | None = None
        self._of_site: dict[int, list[int]] = {}
        for i, b in enumerate(self.buckets):
            self._of_site.setdefault(b.site, []).append(i)
        # Prepended: the values must be in place before any other pre-hook makes views of them
        # (backward masking's held-range views of biases and norm scales).
        self._hooks = [
            model.get_submodule(path).register_forward_pre_hook(self._hook(site), prepend=True)
            for path, site in owners.items()
        ]
        self._flats: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._works: list = [None] * len(self.buckets)
        self._events: list = [None] * len(self.buckets)  # the estimator's timeline handles
        self._world = tuple(range(dist.get_world_size()))
        self._sends = sum(4 * b.numel for b in self.buckets if b.source == rank)  # fp32 bytes
        self._next = len(self.buckets)  # the next bucket to issue (all issued: nothing to do)
        self._open = 0  # issued and not finished

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _hook(self, site: int):
        def pre_forward(module, args) -> None:
            if self._idle:
                return  # the common case: every forward but the first after a step, evaluation
            self._issue_through(site + PREFETCH_SITES)
            pending = [i for i in self._of_site[site] if self._works[i] is not None]
            if pending:
                with self.comm.waiting():
                    for i in pending:
                        self._finish(i)

        return pre_forward

    @property
    def _idle(self) -> bool:
        return self._next == len(self.buckets) and self._open == 0

    def start(self) -> None:
        """After the optimizer step: issue the broadcasts of the first sites. What this rank
        sends is counted in this step, although most of it leaves during the next forward."""
        self.comm.add("weight_refresh", self._sends)
        self._next = 0
        self._issue_through(PREFETCH_SITES)

    def _issue_through(self, site: int) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].site <= site:
            self._issue(self._next)
            self._next += 1

    def _issue(self, i: int) -> None:
        b = self.buckets[i]
        if self.rank == b.source:
            flat = torch.cat([t.src.view().reshape(-1) for t in b.transfers]).to(self.device)
        else:
            flat = torch.empty(b.numel, dtype=torch.float32, device=self.device)
        self._flats[i] = flat
        self._works[i] = dist.broadcast(flat, src=b.source, async_op=True)
        self._events[i] = self.comm.event("broadcast", "weight_refresh", 4 * b.numel, self._world)
        self._open += 1
        if self.trace is not None:
            self.trace.append(("world", "weight_refresh", i))

    def _finish(self, i: int) -> None:
        """Wait for bucket i and write its values where this rank keeps them."""
        self._works[i].wait()
        self.comm.need(self._events[i])
        flat, offset = self._flats[i], 0
        for t in self.buckets[i].transfers:
            if t.dst is not None:
                view = t.dst.view()
                view.copy_(flat[offset : offset + t.numel].view_as(view))
            offset += t.numel
        self._flats[i], self._works[i] = None, None
        self._open -= 1

    def wait_all(self) -> None:
        """Issue and finish every broadcast still outstanding (collective when any is). Not
        counted as exposed communication: it runs outside the steps (evaluation, checkpoints)."""
        if self._idle:
            return
        self._issue_through(len(self.buckets))
        for i, work in enumerate(self._works):
            if work is not None:
                self._finish(i)
