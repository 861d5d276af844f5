"""Backward masking's weight refresh, overlapped with the next forward.

After every optimizer step each rank's non-held weight ranges are stale: their
holders updated them. `WeightRefresh` broadcasts them from their senders in
forward order, asynchronously, and makes the next forward wait only where it
needs them: each module that owns refreshed tensors waits, in a forward
pre-hook, for the buckets carrying them, so the first layers compute while
later ones are still arriving.

A site is one unit group (a layer's attention or MLP, or a whole block). Each
sender's values are cut into buckets in the order the forward meets the sites
(a small first bucket, then `parallelism.bucket_cap_mb`, so a bucket can span
small sites and one collective's latency is paid for enough bytes), and every
rank issues all the buckets right after its optimizer step, in one order on the
world group: by the first site they serve. Issuing them all at once, rather
than a site ahead of the forward, keeps a rank's forward from waiting on a
slower sender's forward (measured on 4 CPU processes: 13 ms exposed a step
instead of 52). Their receive buffers (the model's unit weights, once) are
alive from the step's end into the forward, which frees them site by site: a
backward-masking step peaks at the end of its forward, when they are gone, unless activation
checkpointing keeps the forward small: then the step peaks just after the optimizer, with every
buffer issued (llama_1b, 8 workers, C = 0.75, full AC, bf16: 21.1 GiB there, 17.6 at any other
moment; sdp.planning.segments names that moment "after step").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from sdp.metrics.comm import CommCounter
from sdp.subnet.sync import FIRST_BUCKET_BYTES, Transfer, broadcast_from_holders, packed, split_by_size, unpacked


@dataclass(frozen=True)
class RefreshBucket:
    site: int  # the first site (in forward order) it carries values of: where it is first needed
    source: int
    transfers: tuple[Transfer, ...]
    numel: int
    sites: frozenset[int]  # every site it carries values of


def plan_refresh(
    transfers: list[Transfer], *, position: Mapping[str, int], cap_elems: int, first_elems: int
) -> tuple[list[RefreshBucket], dict[str, int]]:
    """The broadcast buckets in issue order, and each owner module's site (by module path).

    A sender's transfers are taken in forward order and cut into buckets of `first_elems`
    (at most `cap_elems`) for its first and `cap_elems` for the others, so a bucket can
    span sites; buckets are issued in the order of the first site they serve. `position`
    is a plain-model tensor's place in the plain model; a site's place in the forward is
    that of its first tensor. Every rank makes the same list."""
    first: dict[int, int] = {}
    for t in transfers:
        first[t.site] = min(first.get(t.site, position[t.name]), position[t.name])
    order = {site: i for i, site in enumerate(sorted(first, key=lambda s: (first[s], s)))}
    by_source: dict[int, list[Transfer]] = {}
    for t in sorted(transfers, key=lambda t: order[t.site]):  # stable: each site's order is every rank's
        by_source.setdefault(t.source, []).append(t)
    buckets = []
    for source, members in sorted(by_source.items()):
        head, rest = _first_bucket(members, min(first_elems, cap_elems))
        for part in [head, *split_by_size(rest, numel=lambda t: t.numel, cap_elems=cap_elems)]:
            if part:
                sites = frozenset(order[t.site] for t in part)
                buckets.append(RefreshBucket(min(sites), source, tuple(part), sum(t.numel for t in part), sites))
    buckets.sort(key=lambda b: (b.site, b.source))  # stable: a sender's buckets keep their order
    owners = {t.name.rpartition(".")[0]: order[t.site] for t in transfers}
    return buckets, owners


def _first_bucket(members: list[Transfer], cap: int) -> tuple[list[Transfer], list[Transfer]]:
    """The leading transfers of at most `cap` elements (at least one), and the rest."""
    size = 0
    for i, t in enumerate(members):
        if i and size + t.numel > cap:
            return members[:i], members[i:]
        size += t.numel
    return members, []


class WeightRefresh:
    """Non-held weight ranges from their senders, overlapped with the next forward (collective).

    `start()` after the optimizer step issues every broadcast; each module's forward
    pre-hook waits for the buckets carrying its pieces; `wait_all()` finishes everything
    (before evaluation, checkpoints, a resample). `trace`, when a list, gets every
    broadcast as ("world", "weight_refresh", bucket index) in issue order.
    """

    def __init__(
        self,
        transfers: list[Transfer],
        *,
        model: nn.Module,
        position: Mapping[str, int],
        rank: int,
        comm: CommCounter,
        bucket_cap_mb: float,
        device: torch.device,
        wait_at: Callable[[str], str] | None = None,
    ):
        """`wait_at(path)`: the module whose forward pre-hook waits for the values of the module
        at `path` (default: that module; a compiled block's path, so that the wait runs outside
        the block's compiled forward, which cannot wait on communication)."""
        self.rank, self.comm, self.device = rank, comm, device
        cap, first = int(bucket_cap_mb * 2**20) // 4, FIRST_BUCKET_BYTES // 4  # fp32 elements
        self.buckets, owners = plan_refresh(transfers, position=position, cap_elems=cap, first_elems=first)
        self.trace: list | None = None
        self._of_site: dict[int, list[int]] = {}
        for i, b in enumerate(self.buckets):
            for site in b.sites:
                self._of_site.setdefault(site, []).append(i)
        # Prepended: the values must be in place before any other pre-hook makes views of them
        # (backward masking's held-range views of biases and norm scales).
        sites_at: dict[str, list[int]] = {}
        for path, site in owners.items():
            sites_at.setdefault(wait_at(path) if wait_at else path, []).append(site)
        self._hooks = [
            model.get_submodule(path).register_forward_pre_hook(self._hook(sorted(set(sites))), prepend=True)
            for path, sites in sites_at.items()
        ]
        self._flats: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._works: list = [None] * len(self.buckets)
        self._events: list = [None] * len(self.buckets)  # the estimator's timeline handles
        self._world = tuple(range(dist.get_world_size()))
        self._sends = sum(4 * b.numel for b in self.buckets if b.source == rank)  # fp32 bytes
        self._open = 0  # issued and not finished

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _hook(self, sites: list[int]):
        def pre_forward(module, args) -> None:
            if not self._open:
                return  # the common case: every forward but the first after a step, evaluation
            pending = sorted({i for site in sites for i in self._of_site[site] if self._works[i] is not None})
            if pending:
                with self.comm.waiting():
                    for i in pending:
                        self._finish(i)

        return pre_forward

    def start(self) -> None:
        """After the optimizer step: issue every broadcast (collective)."""
        self.comm.add("weight_refresh", self._sends)
        for i in range(len(self.buckets)):
            self._issue(i)

    def _issue(self, i: int) -> None:
        b = self.buckets[i]
        if self.rank == b.source:
            flat = packed(b.transfers, dtype=torch.float32, device=self.device)
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
        unpacked(self._flats[i], self.buckets[i].transfers)
        self._flats[i], self._works[i] = None, None
        self._open -= 1

    def wait_all(self) -> None:
        """Finish every broadcast still outstanding. Not counted as exposed communication: it
        runs outside the steps (evaluation, checkpoints, a resample)."""
        for i, work in enumerate(self._works):
            if work is not None:
                self._finish(i)


class Refresh:
    """Backward masking's weight refresh across subnetworks (a resample makes a new one):
    overlapped with the next forward (`WeightRefresh`), or, without `overlap`, broadcast after
    the optimizer step (the reference). Nothing to do under forward masking."""

    def __init__(
        self,
        *,
        rank: int,
        comm: CommCounter,
        bucket_cap_mb: float,
        device: torch.device,
        position: Mapping[str, int],
        overlap: bool,
    ):
        self.rank, self.comm, self.bucket_cap_mb, self.device = rank, comm, bucket_cap_mb, device
        self.position, self.overlap = position, overlap
        self.transfers: list[Transfer] = []
        self.overlapped: WeightRefresh | None = None
        self.trace: list | None = None

    def rebuild(
        self, transfers: list[Transfer], model: nn.Module, *, wait_at: Callable[[str], str] | None = None
    ) -> None:
        """Refresh these non-held ranges of `model` (a new subnetwork's) from now on; `wait_at`:
        see `WeightRefresh` (compiled blocks wait before the block)."""
        if self.overlapped is not None:  # the last subnetwork's, after a resample
            self.overlapped.remove_hooks()
        self.transfers, self.overlapped = transfers, None
        if self.overlap and transfers:
            self.overlapped = WeightRefresh(
                transfers,
                model=model,
                position=self.position,
                rank=self.rank,
                comm=self.comm,
                bucket_cap_mb=self.bucket_cap_mb,
                device=self.device,
                wait_at=wait_at,
            )
        self.trace_collectives(self.trace)

    def trace_collectives(self, trace: list | None) -> None:
        """Record the overlapped broadcasts into `trace` (None: stop)."""
        self.trace = trace
        if self.overlapped is not None:
            self.overlapped.trace = trace

    def after_step(self) -> None:
        """After the optimizer step: refresh the non-held ranges (collective)."""
        if self.overlapped is not None:
            self.overlapped.start()  # the next forward waits for each module's pieces
        elif self.transfers:
            with self.comm.waiting():
                broadcast_from_holders(
                    self.transfers,
                    rank=self.rank,
                    comm=self.comm,
                    kind="weight_refresh",
                    bucket_cap_mb=self.bucket_cap_mb,
                    device=self.device,
                )

    def settle(self) -> None:
        """Finish every overlapped broadcast still in flight."""
        if self.overlapped is not None:
            self.overlapped.wait_all()
