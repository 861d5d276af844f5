"""A rank's estimate, typed: what `sdp.planning.estimator.estimate` traces and the planner extends.

Its `memory` stays what a run's summary.json holds (`sdp.rundir.summary.Summary.memory`): bytes
by name, with the peak's breakdown by kind, so that an estimate and a measurement compare key by
key. `to_json` gives the dict `sdp.estimate out=FILE.json` writes and the trace cache keeps
(`sdp.planning.traces`); `from_json` reads it back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


def in_micro_step(segment: str) -> bool:
    """Whether `segment` (a key of `Estimate.peak_segments`, named by `sdp.planning.segments`) is
    one of a micro-step's (`m forward`, `m head`, `m head backward`, `m backward`), where the
    activations live; not the step's level before them, the sync, the optimizer or after the
    step."""
    return segment.split(" ", 1)[0].isdigit()


@dataclass(frozen=True)
class Estimate:
    """One rank's figures for one step of a run: what is traced, its memory, FLOPs and bytes
    sent, and the collectives the step-time model reads. `method` says how the planner got it
    (traced whole, or extended from shorter traces: `sdp.planning.layered`); `step` holds its
    step on a cluster where the planner asked for one."""

    model: str
    masking: str
    granularity: str | None
    coverage: float | None
    capacity: float | None  # this rank's worker's, under SDP
    holders: dict | None  # how many workers hold a unit: min, mean, max
    world_size: int
    rank: int
    micro_batch: int
    seq_len: int | None
    n_params: int
    outer_on: str | None  # where an outer loop's state lives: device or host
    outer: dict | None  # an outer loop's name, sync_every, fragments, bytes sent a window (by kind; wire)
    memory: dict  # bytes by name; peak_breakdown: the peak's bytes by kind
    peak_segments: dict[str, dict[str, int]]  # each segment's peak by kind (sdp.planning.segments)
    flops_per_step: int
    comm_bytes_per_step: float
    comm_bytes_per_step_by_kind: dict[str, float]
    sync_timelines: list | None  # an outer sync's collectives, per fragment
    sync_segments: dict | None  # an outer sync's peak by moment, by kind
    timeline: list[dict] | None  # the step's collectives (None: not kept)
    precision: str
    trace_s: float
    method: str = "traced"
    step: dict | None = None
    # The step's ops in order, as the step-time model charges them (sdp.metrics.launches.OpTape:
    # launches, flops, bytes, phases); the timeline's issue and need points index into them.
    ops: dict | None = None
    compiled: bool = False  # the run compiles its blocks (the trace runs them eager)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Estimate:
        return cls(**data)
