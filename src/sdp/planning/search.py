"""The planner's search: every structure of `sdp.planning.space`, composed, checked and fitted.

Composing a structure's config through Hydra costs 0.1 to 0.4 s, so each (masking,
parallelism) pair is composed once and its structures are copies with their fields set, then
checked as `load_config` checks them (tests/test_plan_search.py checks the copies equal the
composed configs). A structure the entrypoint would refuse is kept with its one-line reason.

Structures that differ only in coverage, activation checkpointing and an outer loop form a
*family*; a family is fitted from the least memory up, each structure's micro-batch search
starting from the one before it (their peaks are close) and below any micro-batch a structure
holding no more missed at (`known_miss`), and the families are spread over worker processes
(`workers`: by default the CPUs this process may use, `sdp.planning.cores`), forked after the
imports. Of an outer loop's H, one is
fitted and the others derived (`lead_structures`).
"""

from __future__ import annotations

import copy
import dataclasses
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sdp.errors import ConfigError
from sdp.planning.checks import CheckCache, Checked
from sdp.planning.fit import GIB, Fit, fit, fit_peak, resynced, short_run
from sdp.planning.layered import Trace
from sdp.planning.rows import Row
from sdp.planning.space import CHECKPOINTING, Structure, outer_free
from sdp.planning.step_time import Cluster
from sdp.planning.traces import TraceCache, trace_now
from sdp.run.config import RunConfig, apply_protocol, typed_config
from sdp.subnet import capacity_replaces_coverage, is_sdp
from sdp.subnet.modes import masking_overrides


@dataclass
class Outcome:
    """One structure's result: its fit (None: refused, with `reason`) and the seconds it took;
    `lead`: the structure whose traces it was derived from (an outer loop at another H)."""

    structure: Structure
    found: Fit | None
    reason: str = ""
    seconds: float = 0.0
    lead: Structure | None = None
    traces: tuple[int, int] = (0, 0)  # traces made, and read from the cache (sdp.planning.traces)


class Composer:
    """RunConfigs of structures on top of the user's overrides, composed once per (masking,
    parallelism, outer loop or not)."""

    def __init__(self, overrides: list[str], *, world: int, check: CheckCache | None = None):
        self.overrides, self.world = overrides, world
        self.check = check or CheckCache(None)
        self._bases: dict[tuple[str, ...], RunConfig] = {}

    def base(self, masking: str, parallelism: str, outer: bool = False) -> RunConfig:
        """The user's overrides with these (without their outer loop's unless `outer`), composed
        once per distinct list (without an outer loop in the user's, `outer` changes nothing)."""
        own = self.overrides if outer else outer_free(self.overrides)
        key = (*own, *masking_overrides(masking), f"parallelism={parallelism}")
        if key not in self._bases:
            self._bases[key] = typed_config(list(key))
        return self._bases[key]

    def __call__(self, s: Structure) -> RunConfig:
        """The structure's config, checked; ConfigError as the entrypoint would raise it."""
        return self.checked(s)[0]

    def checked(self, s: Structure) -> tuple[RunConfig, Checked]:
        """The structure's config and what its checks told (`sdp.planning.checks`)."""
        cfg = copy.deepcopy(self.base(s.masking, s.parallelism, s.sync_every is not None))
        plain = self.base("none", s.parallelism)  # the step budget before the protocol scales it
        if s.sync_every is not None:
            _set(cfg, "outer.sync_every", s.sync_every)
        for key in ("trainer.max_steps", "optim.warmup_steps"):
            _set(cfg, key, _get(plain, key))
        if s.masking != "none":
            _set(cfg, "masking.granularity", s.granularity)
            _set(cfg, "masking.capacity", None if s.capacity is None else list(s.capacity))
            _set(cfg, "masking.coverage", s.coverage)
            capacity_replaces_coverage(cfg.masking)  # the capacities' mean, where they are given
            _set(cfg, "masking.coverage", cfg.masking.coverage)
        _set(cfg, "parallelism.fsdp_degree", s.fsdp_degree)
        _set(cfg, "parallelism.activation_checkpointing", s.checkpointing)
        _set(cfg, "parallelism.mixed_precision", s.precision)
        apply_protocol(cfg)
        return cfg, self.check(cfg, world_size=self.world)


def _get(cfg: RunConfig, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _set(cfg: RunConfig, key: str, value) -> None:
    """A key of the typed config and of its record (what config.yaml and W&B show) alike."""
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, value)
    cfg.record[section][name] = value


def family_of(s: Structure) -> tuple:
    """What a family shares: all but the coverage (or capacity), the checkpointing and the
    outer loop."""
    return (s.parallelism, s.masking, s.granularity, s.fsdp_degree, s.precision, s.capacity is None)


LEAST_MEMORY = {ac: i for i, ac in enumerate(reversed(CHECKPOINTING))}  # full, selective, none


def size_order(s: Structure) -> tuple:
    """A family's structures from the least memory up: by coverage (or capacities), then
    checkpointing (full first), then without an outer loop before with one."""
    return (s.coverage or 0, s.capacity or (), LEAST_MEMORY[s.checkpointing], s.sync_every is not None)


def no_bigger(a: Structure, b: Structure) -> bool:
    """Whether `a`, of `b`'s family, holds no more than `b` on any rank at any micro-batch: no
    more coverage (each worker no more capacity: under a cyclic mask a rank's units at a lower
    coverage are a subset of its units at a higher one), no less checkpointing, and an outer
    loop only where `b` has one."""
    if a.capacity is not None:
        covered = all(x <= y for x, y in zip(a.capacity, b.capacity, strict=True))
    else:
        covered = (a.coverage or 0) <= (b.coverage or 0)
    less_kept = LEAST_MEMORY[a.checkpointing] <= LEAST_MEMORY[b.checkpointing]
    return covered and less_kept and (a.sync_every is None or b.sync_every is not None)


def known_miss(
    s: Structure, cfg: RunConfig, groups: tuple[int, ...], fitted: list[tuple[Structure, Fit]], devices: list[float]
) -> int | None:
    """The smallest micro-batch at which `s` cannot fit, from the traces of the structures of its
    family fitted before it that hold no more (`no_bigger`): a rank of theirs that, with the
    communicators of `s`'s process groups on that rank (`groups`, each rank's), is over its GPU
    at a micro-batch is over it under `s` too. None when they show none, or when the mask is not
    cyclic (a random mask's units at two coverages are not nested)."""
    if is_sdp(cfg.masking.name) and cfg.masking.construction != "cyclic":
        return None
    found = None
    comm = [int(g * cfg.parallelism.comm_group_overhead_mb * 2**20) for g in groups]
    for a, fit_a in fitted:
        if not no_bigger(a, s):
            continue
        for micro, live in fit_a.traced.items():
            if any(bytes_ + comm[r] > devices[r] * GIB for r, bytes_ in live.items()):
                found = micro if found is None else min(found, micro)
    return found


def families(space: list[Structure]) -> list[list[Structure]]:
    """The space in families, each ordered from the least memory up (`size_order`), the largest
    families first (they are the longest tasks)."""
    out: dict[tuple, list[Structure]] = {}
    for s in space:
        out.setdefault(family_of(s), []).append(s)
    for group in out.values():
        group.sort(key=size_order)
    return sorted(out.values(), key=len, reverse=True)


def fit_family(task: tuple) -> list[Outcome]:
    """Fit a family's structures from the least memory up: the first from the largest
    micro-batch (on GPUs that hold the model it fits there), each next from the one before's
    choice, below the smallest micro-batch that a structure holding no more missed at
    (`known_miss`), and on mixed GPUs walking with the one before's busiest rank. The traces
    decide every choice; the order only spares probes."""
    members, devices, cluster, traces = task
    out, guess = [], members[0][1].trainer.global_batch_size  # the first from the largest micro-batch
    lead = None  # on mixed GPUs, the rank the walk traces (`fit`): the one before's busiest
    fitted: list[tuple[Structure, Fit]] = []
    with traces.steady():  # a structure probed at several micro-batches builds and warms up once
        for s, cfg, checked in members:
            start, before = time.perf_counter(), (traces.made, traces.read)
            below = known_miss(s, cfg, checked.groups, fitted, devices)
            found = fit(
                cfg,
                devices=devices,
                cluster=cluster,
                guess=guess,
                below=below,
                lead=lead,
                checked=checked,
                trace=traces,
            )
            guess, lead = found.micro, found.busiest
            fitted.append((s, found))
            counts = (traces.made - before[0], traces.read - before[1])
            out.append(Outcome(s, _light(found), seconds=time.perf_counter() - start, traces=counts))
    return out


def _light(found: Fit) -> Fit:
    """The fit without its estimates' timelines (they stay in the worker)."""
    ests = {r: dataclasses.replace(e, timeline=None) for r, e in found.estimates.items()}
    return dataclasses.replace(found, estimates=ests)


def _quiet_worker() -> None:
    torch.set_num_threads(1)  # a trace under fake tensors runs no kernels; one thread per process


def search(
    space: list[Structure],
    *,
    compose: Composer,
    devices: list[float],
    cluster: Cluster | None,
    workers: int,
    progress: Callable[[Outcome, int, int], None] | None = None,
    traces: TraceCache | None = None,
) -> list[Outcome]:
    """Every structure's outcome, in the order of `space`. Of a structure's outer loops (the same
    but for H), the first the entrypoint takes is fitted and the others derived from it. `traces`:
    where traces are kept between calls (None: nowhere)."""
    traces = traces or TraceCache(None)
    outcomes: dict[Structure, Outcome] = {}
    composed: dict[Structure, tuple[RunConfig, Checked]] = {}
    for s in space:
        try:
            composed[s] = compose.checked(s)
        except ConfigError as err:
            outcomes[s] = Outcome(s, None, reason=str(err))
    leads = lead_structures(list(composed))
    tasks = []
    for family in families([s for s in composed if leads[s] == s]):
        tasks.append(([(s, *composed[s]) for s in family], devices, cluster, traces))
    done = len(outcomes)
    if workers > 1 and len(tasks) > 1:
        with multiprocessing.get_context("fork").Pool(min(workers, len(tasks)), initializer=_quiet_worker) as pool:
            results = pool.imap_unordered(fit_family, tasks)
            for result in results:
                done = _record(result, outcomes, done, len(space), progress)
    else:
        for task in tasks:
            done = _record(fit_family(task), outcomes, done, len(space), progress)
    derived = [_derived(s, outcomes[lead]) for s, lead in leads.items() if lead != s]
    _record(derived, outcomes, done, len(space), progress)
    return [outcomes[s] for s in space]


def lead_structures(space: list[Structure]) -> dict[Structure, Structure]:
    """Each structure's lead: itself, or for an outer loop, the first of the same structure's
    outer loops in `space` (they differ only in H, which no trace sees)."""
    first: dict[Structure, Structure] = {}
    for s in space:
        if s.sync_every is not None:
            first.setdefault(_plain(s), s)
    return {s: s if s.sync_every is None else first[_plain(s)] for s in space}


def _plain(s: Structure) -> Structure:
    return dataclasses.replace(s, sync_every=None, outer=None)


def _derived(s: Structure, lead: Outcome) -> Outcome:
    """An outer loop's outcome at `s.sync_every` from its lead's fit (`sdp.planning.fit.resynced`)."""
    return Outcome(s, dataclasses.replace(resynced(lead.found, s.sync_every), probes=0), lead=lead.structure)


def _record(result: list[Outcome], outcomes: dict, done: int, total: int, progress) -> int:
    for outcome in result:
        outcomes[outcome.structure] = outcome
        done += 1
        if progress is not None:
            progress(outcome, done, total)
    return done


def verify(row: Row, cfg: RunConfig, *, devices: list[float], trace: Trace = trace_now) -> Row:
    """A row's peaks from whole traces (every layer, at most 2 accumulation steps: the peak of
    any count from 2), replacing the line's (kept in `line_peaks_bytes`); the row as it then
    stands (it may no longer fit)."""
    world = len(devices)
    short, _ = short_run(cfg, world=world, micro=row.micro_batch)
    peaks = {r: fit_peak(trace(short, world_size=world, rank=r).memory) for r in row.peaks_bytes}
    fits = max(p / (devices[r] * GIB) for r, p in peaks.items()) <= 1
    method = "traced whole (verified)"
    gib = {r: devices[r] for r in peaks}
    line = row.peaks_bytes
    return dataclasses.replace(row, peaks_bytes=peaks, devices_gib=gib, line_peaks_bytes=line, fits=fits, method=method)
