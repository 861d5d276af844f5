"""Does a configuration fit these devices, and with which micro-batch?

A rank's peak grows with its micro-batch, so for one structure (`sdp.planning.space`) the
planner wants the largest micro-batch, the fewest accumulation steps, whose every rank fits
its own GPU. `fit` traces the smallest micro-batch first (if that does not fit, nothing
does: the miss is reported with its peak), then bisects the per-rank batch's divisors. Each
probe is `layered_estimate` at exactly that micro-batch, not an extrapolation in it: the peak
is not affine in the micro-batch, since the chunked loss's temporaries grow with it only up to
one chunk (llama_1b: 0.37, 0.75, 0.76, 0.79 GiB at 1, 2, 4, 8).

Ranks that hold the same and sit on GPUs of the same size have the same peak: one of each
kind is traced (the busiest rank alone on equal devices without capacities). The peak a rank
must fit is the estimator's `peak_with_comm_groups_bytes`: its live peak and the NCCL
communicators of the process groups it joins.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sdp.planning.estimator import busiest_rank
from sdp.planning.layered import layered_estimate
from sdp.run.config import RunConfig
from sdp.subnet import is_sdp, sdp_workers

GIB = 2**30


@dataclass
class Fit:
    """The outcome for one configuration: the accumulation steps chosen (None: nothing fits),
    each traced rank's predicted peak and GPU, and the estimates behind them."""

    accum: int | None
    micro: int
    peaks: dict[int, int]  # rank -> predicted peak bytes, communicators included
    gib: dict[int, float]  # rank -> its GPU's GiB
    estimates: dict[int, dict]

    @property
    def fits(self) -> bool:
        return self.accum is not None

    @property
    def headroom(self) -> float:
        """The smallest free share of a traced rank's GPU (negative: over by that share)."""
        return min(1 - self.peaks[r] / (self.gib[r] * GIB) for r in self.peaks)


def traced_ranks(cfg: RunConfig, *, devices: list[float]) -> list[int]:
    """One rank of each kind: the same GPU size and the same capacity (SDP x FSDP: shard 0 of
    its worker); the busiest rank alone when every GPU and every worker is the same."""
    world = len(devices)
    capacity = cfg.masking.capacity if is_sdp(cfg.masking.name) else None
    if capacity is None and len(set(devices)) == 1:
        return [busiest_rank(cfg, world_size=world)]
    per_worker = world // sdp_workers(cfg.parallelism, masking=cfg.masking.name, world_size=world)
    kinds: dict[tuple, int] = {}
    for rank in range(0, world, per_worker):
        kinds.setdefault((devices[rank], None if capacity is None else capacity[rank // per_worker]), rank)
    return sorted(kinds.values())


def fit(cfg: RunConfig, *, devices: list[float]) -> Fit:
    """The largest micro-batch of `cfg` whose every rank fits its GPU (`devices`: GiB per rank)."""
    world = len(devices)
    per_rank = cfg.trainer.global_batch_size // world
    options = [per_rank // a for a in range(1, per_rank + 1) if per_rank % a == 0]  # micro-batches, largest first
    ranks = traced_ranks(cfg, devices=devices)

    def probe(micro: int) -> Fit:
        accum = per_rank // micro
        run = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, grad_accum_steps=accum))
        ests = {r: layered_estimate(run, world_size=world, rank=r) for r in ranks}
        peaks = {r: e["memory"]["peak_with_comm_groups_bytes"] for r, e in ests.items()}
        return Fit(accum, micro, peaks, {r: devices[r] for r in ranks}, ests)

    smallest = probe(options[-1])
    if smallest.headroom < 0:
        return dataclasses.replace(smallest, accum=None)
    best, lo, hi = smallest, 0, len(options) - 1  # options[hi] fits; find the first (largest) that does
    while lo < hi:
        mid = (lo + hi) // 2
        found = probe(options[mid])
        if found.headroom >= 0:
            best, hi = found, mid
        else:
            lo = mid + 1
    return best
