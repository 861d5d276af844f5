"""Does a configuration fit these devices, and with which micro-batch?

A rank's peak grows with its micro-batch, so for one structure (`sdp.planning.space`) the
planner wants the largest micro-batch, the fewest accumulation steps, whose every rank fits
its own GPU. Each probe is `layered_estimate` at exactly that micro-batch, not an
extrapolation in it: the peak is not affine in the micro-batch, since the chunked loss's
temporaries grow with it only up to one chunk (llama_1b: 0.37, 0.75, 0.76, 0.79 GiB at 1, 2,
4, 8). Without a guess, `fit` traces the smallest micro-batch first (if that does not fit,
nothing does: the miss is reported with its peak); with a guess (a similar structure's
choice) it starts there. Each later probe is at the per-rank batch's divisor where the last
probe's peak predicts the boundary (`grown`: its activations in proportion to the
micro-batch, the rest fixed), between the largest divisor known to fit and the smallest known
to miss, until they are neighbours: the prediction only chooses which divisors are traced.

A probe traces at most two accumulation steps (`short_run`): a rank's peak is the same for
every accumulation count from 2 on (the gradients persist from the first micro-step; each
later one is the same), its FLOPs are proportional to the count, and the step-time model's
seconds are affine in it. DDP's and SDP's micro-steps before the last communicate nothing,
so each adds one micro-step's compute; FSDP's gather the weights again, so its slope is
traced (one accumulation step against two). tests/test_plan_fit.py checks the peak and the
step against whole traces.

Ranks that hold the same and sit on GPUs of the same size have the same peak: one of each
kind is traced (the busiest rank alone on equal devices without capacities), and of those
kinds one at each probe, the others only where it lands (`fit`). The peak a rank
must fit is the estimator's `peak_with_comm_groups_bytes`: its live peak and the NCCL
communicators of the process groups it joins; with an outer loop, a sync's peak too, where it
is higher (`fit_peak`).

A run with an outer loop traces the same for every H (`sync_every`): a sync is traced after a
step however many steps apart they are. So the planner fits it once and derives the other H
from that fit (`resynced`): only the window's share of each step's bytes and seconds moves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sdp.planning.checks import Checked
from sdp.planning.estimates import Estimate, in_micro_step
from sdp.planning.layered import Trace, extend_steps, layered_estimate
from sdp.planning.ranks import busiest_rank
from sdp.planning.step_time import Cluster, resync
from sdp.planning.traces import trace_now
from sdp.run.config import RunConfig
from sdp.subnet import is_sdp, sdp_workers

GIB = 2**30
SHORT_ACCUM = 2  # the accumulation steps a probe traces at most


@dataclass
class Fit:
    """The outcome for one configuration: the accumulation steps chosen (None: nothing fits),
    each traced rank's predicted peak and GPU, and the estimates behind them."""

    accum: int | None
    micro: int
    peaks: dict[int, int]  # rank -> predicted peak bytes, communicators included
    gib: dict[int, float]  # rank -> its GPU's GiB
    estimates: dict[int, Estimate]  # rank -> its (short) estimate
    probes: int = 1  # micro-batches traced to decide
    step: dict | None = None  # the slowest traced rank's `step_times` at `accum` (with a cluster)
    # micro-batch -> traced rank -> its peak without the communicators, for every micro-batch traced
    traced: dict[int, dict[int, int]] = dataclasses.field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.accum is not None

    @property
    def busiest(self) -> int:
        """The traced rank that fills the largest share of its GPU."""
        return busiest_of(self.peaks, self.gib)

    @property
    def headroom(self) -> float:
        """The smallest free share of a traced rank's GPU (negative: over by that share)."""
        return min(1 - self.peaks[r] / (self.gib[r] * GIB) for r in self.peaks)


def busiest_of(peaks: dict[int, int], gib: dict[int, float]) -> int:
    """The rank of `peaks` (bytes) that fills the largest share of its GPU (`gib`: GiB by rank)."""
    return max(peaks, key=lambda r: peaks[r] / gib[r])


def traced_ranks(cfg: RunConfig, *, devices: list[float], busiest: int | None = None) -> list[int]:
    """One rank of each kind: the same GPU size and the same capacity (SDP x FSDP: shard 0 of
    its worker); the busiest rank alone (`busiest`, when known) when every GPU and every worker
    is the same."""
    world = len(devices)
    capacity = cfg.masking.capacity if is_sdp(cfg.masking.name) else None
    if capacity is None and len(set(devices)) == 1:
        return [busiest_rank(cfg, world_size=world) if busiest is None else busiest]
    per_worker = world // sdp_workers(cfg.parallelism, masking=cfg.masking.name, world_size=world)
    kinds: dict[tuple, int] = {}
    for rank in range(0, world, per_worker):
        kinds.setdefault((devices[rank], None if capacity is None else capacity[rank // per_worker]), rank)
    return sorted(kinds.values())


def short_run(cfg: RunConfig, *, world: int, micro: int) -> tuple[RunConfig, int]:
    """`cfg` at micro-batch `micro`, with at most SHORT_ACCUM accumulation steps (the global
    batch shrunk to match), and the accumulation steps of the real run."""
    accum = cfg.trainer.global_batch_size // world // micro
    short = min(accum, SHORT_ACCUM)
    trainer = dataclasses.replace(cfg.trainer, grad_accum_steps=short, global_batch_size=micro * world * short)
    return dataclasses.replace(cfg, trainer=trainer), accum


def probe(
    cfg: RunConfig,
    *,
    devices: list[float],
    ranks: list[int],
    micro: int,
    cluster: Cluster | None,
    trace: Trace = trace_now,
    checked: Checked | None = None,
) -> Fit:
    """Every traced rank's peak at micro-batch `micro` (accumulation chosen to fill the batch);
    `checked`: what the config's checks told, when known."""
    world = len(devices)
    short, accum = short_run(cfg, world=world, micro=micro)
    ests = {
        r: layered_estimate(short, world_size=world, rank=r, cluster=cluster, trace=trace, spread=_spread(checked, r))
        for r in ranks
    }
    peaks = {r: fit_peak(e.memory) for r, e in ests.items()}
    return Fit(accum, micro, peaks, {r: devices[r] for r in ranks}, ests)


def _spread(checked: Checked | None, rank: int) -> float | None:
    """The rank's layer spread the config's checks told; None when they did not."""
    return None if checked is None or checked.spread is None else checked.spread[rank]


def fit_peak(mem: dict) -> int:
    """The bytes a rank's GPU must hold, from its estimate's memory: the step's peak or an outer
    sync's, whichever is higher, and the communicators of its process groups."""
    above = mem.get("sync_peak_bytes", 0) - mem.get("peak_bytes", 0)  # how far a sync peaks above the step
    return mem["peak_with_comm_groups_bytes"] + max(0, above)


def resynced(found: Fit, every: int) -> Fit:
    """`found`, a run with an outer loop, as the same run syncing every `every` steps: each
    estimate's bytes per step (a window's sync bytes spread over `every` steps) and its step."""
    ests = {r: _resynced(e, every) for r, e in found.estimates.items()}
    return dataclasses.replace(found, estimates=ests, step=found.step and resync(found.step, every=every))


def _resynced(est: Estimate, every: int) -> Estimate:
    outer, by_kind = est.outer, dict(est.comm_bytes_per_step_by_kind)
    for kind, nbytes in outer["bytes_per_sync"].items():
        by_kind[kind] += nbytes / every - nbytes / outer["sync_every"]
    return dataclasses.replace(
        est,
        outer={**outer, "sync_every": every},
        comm_bytes_per_step_by_kind=by_kind,
        comm_bytes_per_step=sum(by_kind.values()),
        step=est.step and resync(est.step, every=every),
    )


def step_at(
    cfg: RunConfig,
    found: Fit,
    *,
    devices: list[float],
    cluster: Cluster,
    trace: Trace = trace_now,
    checked: Checked | None = None,
) -> dict:
    """The step on `cluster` at the fit's accumulation: the slowest traced rank's, extended from
    the short trace (see the module doc); `checked` as for `probe`."""
    world, short = len(devices), min(found.accum, SHORT_ACCUM)
    rank = max(found.estimates, key=lambda r: found.estimates[r].step["step_overlapped_s"])
    step = found.estimates[rank].step
    if found.accum == short:
        return step
    if cfg.parallelism.name == "fsdp":
        trainer = dataclasses.replace(cfg.trainer, grad_accum_steps=1, global_batch_size=found.micro * world)
        single = dataclasses.replace(cfg, trainer=trainer)  # one micro-step of the same size
        spread = _spread(checked, rank)
        one = layered_estimate(single, world_size=world, rank=rank, cluster=cluster, trace=trace, spread=spread).step
        return extend_steps(one, step, found.accum - 1)
    per_micro = step["micro_step_s"]  # a micro-step past the traced ones (sdp.planning.step_time)
    keys = ("compute_s", "step_serial_s", "step_overlapped_s")
    return {**step, **{k: step[k] + (found.accum - short) * per_micro for k in keys}}


def fit(
    cfg: RunConfig,
    *,
    devices: list[float],
    cluster: Cluster | None = None,
    guess: int | None = None,
    below: int | None = None,
    lead: int | None = None,
    checked: Checked | None = None,
    trace: Trace = trace_now,
) -> Fit:
    """The largest micro-batch of `cfg` whose every rank fits its GPU (`devices`: GiB per rank),
    starting from `guess` when given; with a cluster, its step there (`Fit.step`). `below`: a
    micro-batch known not to fit (from a structure that takes no more memory, `known_miss`): only
    smaller ones are tried (micro-batch 1 still is, for its peak). `checked`: what the config's
    checks told (`sdp.planning.checks`: the busiest rank, each rank's spread), when known, so
    that no SDP plan is built again. `trace` makes each trace (`sdp.planning.layered`).

    Where ranks of several kinds are traced (`traced_ranks`), the walk traces one, `lead` (the
    one on the smallest GPU unless given: a similar structure's busiest), and the others at
    the micro-batch it chooses; if one of them is over its GPU there, the walk runs again below
    it with every rank. A peak grows with the micro-batch, so the choice and the peaks are those
    of a walk that traces every rank at every probe (tests/test_plan_fit.py): only traces are
    spared."""
    per_rank = cfg.trainer.global_batch_size // len(devices)
    options = [m for m in range(1, per_rank + 1) if per_rank % m == 0]  # micro-batches, smallest first
    n = max(1, sum(below is None or m < below for m in options))
    ranks = traced_ranks(cfg, devices=devices, busiest=None if checked is None else checked.busiest_rank)
    seen: list[Fit] = []

    def at(i: int, who: list[int] = ranks) -> Fit:
        seen.append(
            probe(cfg, devices=devices, ranks=who, micro=options[i], cluster=cluster, trace=trace, checked=checked)
        )
        return seen[-1]

    start = None if guess is None else max(i for i, m in enumerate(options[:n]) if m <= guess)
    walker = lead if lead in ranks else min(ranks, key=lambda r: devices[r])
    found = _walk(at if len(ranks) == 1 else lambda i: at(i, [walker]), options[:n], start)
    if len(ranks) > 1:
        i = options.index(found.micro)
        rest = at(i, [r for r in ranks if r != walker])
        if rest.headroom >= 0 or not found.fits:  # they fit there too, or nothing fits
            found = _joined(found, rest)
        else:  # one of them is over where the lead fits: every rank, below that micro-batch
            found = _walk(at, options[:i], None) if i > 0 else _joined(found, rest)
    traced: dict[int, dict[int, int]] = {}
    for f in seen:
        traced.setdefault(f.micro, {}).update(
            {r: p - f.estimates[r].memory["comm_group_bytes"] for r, p in f.peaks.items()}
        )
    found = dataclasses.replace(found, probes=len(traced), traced=traced)
    if found.fits and cluster is not None:
        found.step = step_at(cfg, found, devices=devices, cluster=cluster, trace=trace, checked=checked)
    return found


def _joined(lead: Fit, rest: Fit) -> Fit:
    """One micro-batch's probes of the lead rank and of the others, as one (it fits if all fit),
    rank by rank in order."""

    def both(a: dict, b: dict) -> dict:
        return dict(sorted({**a, **b}.items()))

    return dataclasses.replace(
        lead,
        accum=lead.accum if rest.headroom >= 0 else None,
        peaks=both(lead.peaks, rest.peaks),
        gib=both(lead.gib, rest.gib),
        estimates=both(lead.estimates, rest.estimates),
    )


def _walk(at, options: list[int], start: int | None) -> Fit:
    """The fit at the largest micro-batch of `options` (ascending) that fits; the smallest's miss
    when none does. From `start` (an index; the smallest without one), each probe is where the
    last one predicts the boundary (`_predicted`), kept strictly between the largest index known
    to fit and the smallest known to miss; the walk ends when they are neighbours. A peak grows
    with the micro-batch, so the answer is the one probing every index gives: the prediction
    only decides which probes are spared."""
    known: dict[int, Fit] = {}
    fits, misses = -1, len(options)  # the largest index known to fit; the smallest known to miss
    i = start or 0
    while fits + 1 < misses:
        known[i] = at(i)
        if known[i].headroom >= 0:
            fits = i
        else:
            misses = i
        i = min(max(_predicted(known[i], options), fits + 1), misses - 1)
    return known[fits] if fits >= 0 else dataclasses.replace(known[0], accum=None)


def _predicted(found: Fit, options: list[int]) -> int:
    """The index of the largest micro-batch of `options` at which every rank of `found` would
    fit, by `grown` (0 when none would)."""

    def fits(micro: int) -> bool:
        return all(grown(found.estimates[r], found.micro, micro) <= found.gib[r] * GIB for r in found.peaks)

    return max((i for i, m in enumerate(options) if fits(m)), default=0)


def grown(est: Estimate, micro: int, to: int) -> float:
    """`fit_peak` of `est`, traced at micro-batch `micro`, guessed at micro-batch `to`: in each
    micro-step's segments of the step (sdp.planning.segments) the activations in proportion to
    the micro-batch; the rest, and the segments after the micro-steps (the gradients' sync, the
    optimizer, what the step leaves behind), as traced. A guess: the temporaries of a backward
    grow too, the chunked loss's stop at a chunk, and FSDP's gathered weights never grow."""
    scale = to / micro - 1
    live = max(
        peak["total"] + (scale * peak["activations"] if in_micro_step(name) else 0)
        for name, peak in est.peak_segments.items()
    )
    mem = est.memory
    return fit_peak({**mem, "peak_bytes": live, "peak_with_comm_groups_bytes": live + mem["comm_group_bytes"]})
