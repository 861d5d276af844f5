"""The planner's search: every structure of `sdp.planning.space`, composed, checked and fitted.

Composing a structure's config through Hydra costs 0.1 to 0.4 s, so each (masking,
parallelism) pair is composed once and its structures are copies with their fields set, then
checked as `load_config` checks them (tests/test_plan_search.py checks the copies equal the
composed configs). A structure the entrypoint would refuse is kept with its one-line reason.

Structures that differ only in coverage and activation checkpointing form a *family*; a
family is fitted in order, each structure's micro-batch search starting from the one before
it (their peaks are close), and the families are spread over worker processes (`workers`,
2 on this 2-core machine), forked after the imports.
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
from sdp.planning.estimator import estimate
from sdp.planning.fit import GIB, Fit, fit, short_run
from sdp.planning.space import CHECKPOINTING, Structure
from sdp.planning.step_time import Cluster
from sdp.run.config import RunConfig, apply_protocol, typed_config, validate
from sdp.subnet import capacity_replaces_coverage


@dataclass
class Outcome:
    """One structure's result: its fit (None: refused, with `reason`) and the seconds it took."""

    structure: Structure
    found: Fit | None
    reason: str = ""
    seconds: float = 0.0


class Composer:
    """RunConfigs of structures on top of the user's overrides, composed once per (masking,
    parallelism) pair."""

    def __init__(self, overrides: list[str], *, world: int):
        self.overrides, self.world = overrides, world
        self._bases: dict[tuple[str, str], RunConfig] = {}

    def base(self, masking: str, parallelism: str) -> RunConfig:
        key = (masking, parallelism)
        if key not in self._bases:
            self._bases[key] = typed_config([*self.overrides, f"masking={masking}", f"parallelism={parallelism}"])
        return self._bases[key]

    def __call__(self, s: Structure) -> RunConfig:
        """The structure's config, checked; ConfigError as the entrypoint would raise it."""
        cfg = copy.deepcopy(self.base(s.masking, s.parallelism))
        plain = self.base("none", s.parallelism)  # the step budget before the protocol scales it
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
        validate(cfg, world_size=self.world, offline=True, check_data=False)
        return cfg


def _get(cfg: RunConfig, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _set(cfg: RunConfig, key: str, value) -> None:
    """A key of the typed config and of its record (what config.yaml and W&B show) alike."""
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, value)
    cfg.record[section][name] = value


def family_of(s: Structure) -> tuple:
    """What a family shares: all but the coverage (or capacity) and the checkpointing."""
    return (s.parallelism, s.masking, s.granularity, s.fsdp_degree, s.precision, s.capacity is None)


def families(space: list[Structure]) -> list[list[Structure]]:
    """The space in families, each ordered by coverage (largest first) then checkpointing, the
    largest families first (they are the longest tasks)."""
    out: dict[tuple, list[Structure]] = {}
    for s in space:
        out.setdefault(family_of(s), []).append(s)
    order = {ac: i for i, ac in enumerate(CHECKPOINTING)}
    for group in out.values():
        group.sort(key=lambda s: (-(s.coverage or 0), s.capacity and [-c for c in s.capacity], order[s.checkpointing]))
    return sorted(out.values(), key=len, reverse=True)


def fit_family(task: tuple) -> list[Outcome]:
    """Fit a family's structures in order: the first from the largest micro-batch (on GPUs that
    hold the model it fits there), each next from the one before's."""
    pairs, devices, cluster = task
    out, guess = [], pairs[0][1].trainer.global_batch_size  # the first from the largest micro-batch
    for s, cfg in pairs:
        start = time.perf_counter()
        found = fit(cfg, devices=devices, cluster=cluster, guess=guess)
        guess = found.micro
        out.append(Outcome(s, _light(found), seconds=time.perf_counter() - start))
    return out


def _light(found: Fit) -> Fit:
    """The fit without its estimates' timelines (they stay in the worker)."""
    ests = {r: {k: v for k, v in e.items() if k != "timeline"} for r, e in found.estimates.items()}
    return dataclasses.replace(found, estimates=ests)


def _quiet_worker() -> None:
    torch.set_num_threads(1)  # a trace under fake tensors runs no kernels; one thread per process


def search(
    space: list[Structure],
    *,
    compose: Callable[[Structure], RunConfig],
    devices: list[float],
    cluster: Cluster | None,
    workers: int,
    progress: Callable[[Outcome, int, int], None] | None = None,
) -> list[Outcome]:
    """Every structure's outcome, in the order of `space`."""
    outcomes: dict[Structure, Outcome] = {}
    tasks = []
    for family in families(space):
        pairs = []
        for s in family:
            try:
                pairs.append((s, compose(s)))
            except ConfigError as err:
                outcomes[s] = Outcome(s, None, reason=str(err))
        if pairs:
            tasks.append((pairs, devices, cluster))
    done = len(outcomes)
    if workers > 1 and len(tasks) > 1:
        with multiprocessing.get_context("fork").Pool(min(workers, len(tasks)), initializer=_quiet_worker) as pool:
            results = pool.imap_unordered(fit_family, tasks)
            for result in results:
                done = _record(result, outcomes, done, len(space), progress)
    else:
        for task in tasks:
            done = _record(fit_family(task), outcomes, done, len(space), progress)
    return [outcomes[s] for s in space]


def _record(result: list[Outcome], outcomes: dict, done: int, total: int, progress) -> int:
    for outcome in result:
        outcomes[outcome.structure] = outcome
        done += 1
        if progress is not None:
            progress(outcome, done, total)
    return done


def verify(row: dict, cfg: RunConfig, *, devices: list[float]) -> dict:
    """A row's peaks from whole traces (every layer, at most 2 accumulation steps: the peak of
    any count from 2), replacing the line's; the row as it then stands (it may no longer fit)."""
    world = len(devices)
    short, _ = short_run(cfg, world=world, micro=row["micro_batch"])
    peaks = {
        int(r): estimate(short, world_size=world, rank=int(r))["memory"]["peak_with_comm_groups_bytes"]
        for r in row["peaks_bytes"]
    }
    share = {r: p / (devices[r] * GIB) for r, p in peaks.items()}
    busiest = max(share, key=share.get)
    return {
        **row,
        "line_peaks_bytes": row["peaks_bytes"],
        "peaks_bytes": peaks,
        "peaks_gib": {r: round(p / GIB, 3) for r, p in peaks.items()},
        "busiest_rank": busiest,
        "peak_gib": round(peaks[busiest] / GIB, 3),
        "headroom": round(1 - share[busiest], 4),
        "fits": share[busiest] <= 1,
        "method": "traced whole (verified)",
    }
