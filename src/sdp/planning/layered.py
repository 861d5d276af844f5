"""The planner's estimate of a run: two small traces and a line, for a model of identical layers.

A LLaMA's decoder layers are identical, so at a fixed micro-batch every figure the estimator
counts (parameters, gradients and optimizer state, FLOPs, bytes sent) is affine in the number
of layers L: the embedding, head and loss once, each layer the same again. `layered_estimate`
traces the run with 3 and 4 layers and extends the line to L.

The peak is not one line but the largest of several: each moment of the step (the end of the
decoder stack's forward, the loss on top of it, the backward with the gradients made so far,
clipping, the optimizer, the weight refresh's receive buffers after it) is affine in L with a
slope of its own, and the moment that peaks at 3 and 4 layers need not peak at L. So the
estimator keeps the peak of each segment of the step (sdp.planning.segments), the line extends
each segment's on its own, and the largest is the peak. Measured for llama_1b (24 layers,
K = 8, micro-batch 8, 2 accumulation steps; docs/plan.md has the table): within 0.012% of the
whole trace on twelve configurations; one line through the step's peaks was 16.7% under for
N-SDP backward C=0.75 + full AC + bf16 (clipping peaks at 3 and 4 layers, the refresh at 24)
and 8.4% under for forward C=0.75 + full AC + bf16. tests/test_plan_layered.py checks tiny
LLaMAs' figures to the byte, one of them with such a change of moment.

A layer's figures are the same only if the rank holds as many units in every layer: a group
of few units cut into K chunks (12 heads in 8) holds one more in some layers than in others.
`layer_spread` measures that on the mask; past SPREAD the run is traced whole, as are models
whose layers differ (ResNet, Swin). Block-level SDP holds whole layers, which ones depending
on the depth: under forward masking a rank runs only those, so its figures are a line in how
many it holds (`block_line`: the same rank in two shallower models; exact on 6 llama_1b
configurations, docs/plan.md); under backward masking it is traced whole. The process groups
a rank joins are the short traces' (a neuron mask has the same holder sets at any depth; the
block line counts the full model's). The collective
timeline is not extended (`timeline` is None): with a cluster, the step-time model runs on
each short trace and its seconds are extended the same way (`step`): within 0.01% of the
whole trace's overlapped step for llama_1b on h100_nvlink and 0.5% on 2 nodes of h100_ib.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from sdp.errors import ConfigError
from sdp.metrics.memory import outer_keys
from sdp.models import build_on_meta
from sdp.outer import is_outer
from sdp.planning.estimates import Estimate
from sdp.planning.ranks import planned_groups
from sdp.planning.step_time import Cluster, step_times
from sdp.planning.traces import trace_now
from sdp.run.config import RunConfig
from sdp.subnet import is_sdp, sdp_workers
from sdp.subnet.modes import mode_of
from sdp.subnet.plan import SubnetPlan

SHORT = (3, 4)  # the depths traced (shallower models peak elsewhere: see the module doc)
SPREAD = 0.005  # the most `layer_spread` the line is taken at; past it the model is traced whole
HEAD = "model.norm"  # transformers' LLaMA: the final norm, where the decoder stack ends
Trace = Callable[..., Estimate]  # estimate's signature: (cfg, *, world_size, rank, head=None) -> its figures


def extends(cfg: RunConfig) -> bool:
    """Whether `cfg`'s estimate is affine in its number of layers (see the module doc)."""
    block_sdp = is_sdp(cfg.masking.name) and cfg.masking.granularity == "block"
    return cfg.model.family == "llama" and not block_sdp and cfg.model.num_layers > max(SHORT) and _whole_syncs(cfg)


def _whole_syncs(cfg: RunConfig) -> bool:
    """No outer loop, or one that syncs the whole model at once: Streaming DiLoCo's fragments
    split the blocks in P runs, at another place in a shallower model, so a sync's peak (the
    largest fragment's) is not on a line in the depth."""
    return not is_outer(cfg.outer) or cfg.outer.fragments == 1


def layer_spread(cfg: RunConfig, *, world_size: int, rank: int) -> float:
    """How far the line is from `rank`'s held units: for each kind of unit group (heads, FFN
    neurons), |held in all layers - held on the line| / held in all layers, the largest. The
    line counts the layers past the short traces as copies of their last layer; a mask whose
    chunks differ by a unit (few units in a group: 12 heads in 8 chunks) holds more in some
    layers than in others. 0 without SDP."""
    if not is_sdp(cfg.masking.name):
        return 0.0
    return spread_of(_subnet_plan(cfg, world_size=world_size), rank=rank)


def spread_of(plan: SubnetPlan, *, rank: int) -> float:
    """`layer_spread` from the run's SDP plan (a LLaMA's: a block is a layer)."""
    layers = {path: i for i, path in enumerate(plan.block_paths)}
    held: dict[str, list[int]] = {}
    for g, group in enumerate(plan.spec.groups):
        counts = held.setdefault(group.kind, [0] * len(layers))
        counts[layers[plan.enclosing_block(group.name)]] += plan.mask.held_units(plan.worker_of(rank), g).size
    first, last = SHORT[0], len(layers) - SHORT[0]
    off = [abs(sum(c) - sum(c[:first]) - last * c[first]) / sum(c) for c in held.values() if sum(c)]
    return max(off, default=0.0)


def with_layers(cfg: RunConfig, layers: int) -> RunConfig:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=layers))


def layered_estimate(
    cfg: RunConfig,
    *,
    world_size: int,
    rank: int,
    cluster: Cluster | None = None,
    trace: Trace = trace_now,
    spread: float | None = None,
) -> Estimate:
    """`sdp.planning.estimator.estimate`'s figures for `rank`, from two short traces when the
    model allows (`method` says which); the whole trace otherwise. With a cluster, `step` holds
    `step_times` on it (None without). `trace`: what makes each trace (the planner's reads
    them from its cache, `sdp.planning.traces`). `spread`: the rank's `layer_spread`, when
    known (the config's checks found it, `sdp.planning.checks`)."""
    line = block_line(cfg, world_size=world_size, rank=rank) if block_forward(cfg) else None
    if line is not None:
        shorts, times = line
        one, two = (trace(short, world_size=world_size, rank=rank, head=HEAD) for short in shorts)
        est = extended(one, two, times, cluster=cluster)
        return dataclasses.replace(
            est,
            n_params=_subnet_plan(cfg, world_size=world_size).full_params,
            memory=_with_groups(est.memory, cfg, world_size=world_size, rank=rank),
            method=f"{' and '.join(str(c.model.num_layers) for c in shorts)} layers, extended in held blocks",
        )
    if not extends(cfg) or (layer_spread(cfg, world_size=world_size, rank=rank) if spread is None else spread) > SPREAD:
        whole = trace(cfg, world_size=world_size, rank=rank)
        return dataclasses.replace(whole, method="traced", step=None if cluster is None else step_times(whole, cluster))
    one, two = (trace(with_layers(cfg, n), world_size=world_size, rank=rank, head=HEAD) for n in SHORT)
    layers = cfg.model.num_layers
    method = f"layers {SHORT[0]} and {SHORT[1]}, extended to {layers}"
    return dataclasses.replace(extended(one, two, layers - SHORT[0], cluster=cluster), method=method)


def extended(one: Estimate, two: Estimate, times: float, *, cluster: Cluster | None = None) -> Estimate:
    """The estimate on the line through the estimates `one` and `two`, `times` their difference
    past `one`: static bytes, each segment's peak (the largest is the peak), FLOPs, bytes sent;
    with a cluster, `step`. The rest (process groups, shapes) is `two`'s."""

    def line(a: float, b: float) -> int:
        return round(a + times * (b - a))

    mem1, mem2 = one.memory, two.memory
    memory = dict(mem2)
    for key in ("params_bytes", "grads_bytes", "optim_bytes", *outer_keys(mem1)):
        if key in mem1:
            memory[key] = line(mem1[key], mem2[key])

    def on_line(first: dict, second: dict) -> dict:  # each segment's peak, kind by kind, and their total
        out = {
            name: {kind: line(b, second[name][kind]) for kind, b in peak.items() if kind != "total"}
            for name, peak in first.items()
        }
        for peak in out.values():
            peak["total"] = sum(peak.values())
        return out

    segments = on_line(one.peak_segments, two.peak_segments)
    breakdown = max(segments.values(), key=lambda peak: peak["total"])
    syncs = one.sync_segments and on_line(one.sync_segments, two.sync_segments)
    if syncs:  # an outer sync's peak: the largest of its moments', each on its own line
        memory["sync_peak_bytes"] = max(peak["total"] for peak in syncs.values())
    memory |= {"peak_bytes": breakdown["total"], "peak_breakdown": breakdown}
    memory["peak_with_comm_groups_bytes"] = breakdown["total"] + memory["comm_group_bytes"]
    by_kind = two.comm_bytes_per_step_by_kind
    outer = two.outer
    if outer is not None:  # a sync's bytes, kind by kind, and on the wire
        sent = outer["bytes_per_sync"]
        outer = {
            **outer,
            "bytes_per_sync": {k: line(v, sent[k]) for k, v in one.outer["bytes_per_sync"].items()},
            "wire_bytes_per_sync": line(one.outer["wire_bytes_per_sync"], outer["wire_bytes_per_sync"]),
        }
    return dataclasses.replace(
        two,
        outer=outer,
        memory=memory,
        n_params=line(one.n_params, two.n_params),
        flops_per_step=line(one.flops_per_step, two.flops_per_step),
        comm_bytes_per_step=line(one.comm_bytes_per_step, two.comm_bytes_per_step),
        comm_bytes_per_step_by_kind={k: line(v, by_kind[k]) for k, v in one.comm_bytes_per_step_by_kind.items()},
        peak_segments=segments,
        sync_segments=syncs,
        timeline=None,
        ops=None,  # the short traces' own: the step on a cluster is theirs, extended
        step=None if cluster is None else extend_steps(step_times(one, cluster), step_times(two, cluster), times),
        trace_s=round(one.trace_s + two.trace_s, 2),
    )


def block_forward(cfg: RunConfig) -> bool:
    """Forward masking of a LLaMA's blocks on whole workers: a rank runs the blocks it holds and
    skips the others, so its figures are affine in how many it holds (`block_line`)."""
    return (
        cfg.model.family == "llama"
        and is_sdp(cfg.masking.name)
        and mode_of(cfg.masking.name).runs_subnetwork
        and cfg.masking.granularity == "block"
        and cfg.parallelism.name == "ddp"
        and _whole_syncs(cfg)
    )


def held_blocks(cfg: RunConfig, *, world_size: int) -> list[int] | None:
    """How many blocks each rank holds under `cfg`'s mask; None when its masking refuses the
    model (a capacity its blocks cannot give)."""
    try:
        plan = _subnet_plan(cfg, world_size=world_size)
    except ConfigError:
        return None
    groups = range(len(plan.spec.groups))
    return [sum(plan.mask.held_units(plan.worker_of(r), g).size for g in groups) for r in range(world_size)]


def block_line(cfg: RunConfig, *, world_size: int, rank: int) -> tuple[tuple[RunConfig, RunConfig], float] | None:
    """Two shallower LLaMAs where `rank` holds l < h blocks, at least SHORT[0] (fewer: the step
    peaks elsewhere, as in a shallow model), and every rank holds one: (the two configs, how many
    times h - l the blocks `rank` holds in `cfg` are past l); None when there are none. The rank
    is the same in all three: which pieces it is the first holder of (those whose squares
    clipping's norm sums) does not change with depth."""
    full = held_blocks(cfg, world_size=world_size)
    found: dict[int, RunConfig] = {}  # blocks `rank` holds -> the shallowest model where it does
    for layers in range(1, cfg.model.num_layers if full else 0):
        short = with_layers(cfg, layers)
        counts = held_blocks(short, world_size=world_size)
        if counts and min(counts) >= 1 and counts[rank] >= SHORT[0]:
            found.setdefault(counts[rank], short)
        if len(found) == 2:
            (low, one), (high, two) = sorted(found.items())
            return (one, two), (full[rank] - low) / (high - low)
    return None


def _subnet_plan(cfg: RunConfig, *, world_size: int) -> SubnetPlan:
    """The run's SDP plan (its mask, units and holder sets), on the meta device."""
    workers = sdp_workers(cfg.parallelism, masking=cfg.masking.name, world_size=world_size)
    fsdp = cfg.parallelism.fsdp_degree if cfg.parallelism.name == "fsdp" else 1
    model = build_on_meta(cfg.model)
    return SubnetPlan.build(model, cfg.masking, family=cfg.model.family, workers=workers, fsdp_degree=fsdp)


def _with_groups(memory: dict, cfg: RunConfig, *, world_size: int, rank: int) -> dict:
    """`memory` with the communicators of the process groups `rank` joins in `cfg` (a block mask's
    holder sets depend on the depth)."""
    groups = planned_groups(cfg, world_size=world_size)[rank]
    allowance = int(groups * cfg.parallelism.comm_group_overhead_mb * 2**20)
    return {
        **memory,
        "comm_groups": groups,
        "comm_group_bytes": allowance,
        "peak_with_comm_groups_bytes": memory["peak_bytes"] + allowance,
    }


def extend_steps(first: dict, second: dict, times: float) -> dict:
    """`step_times` figures on the line through `first` and `second`, `times` steps past `first`
    (each second, and each kind's exposed seconds)."""
    out = {k: _on_line(v, second[k], times) for k, v in first.items() if k != "exposed_by_kind_s"}
    kinds = first["exposed_by_kind_s"].keys() | second["exposed_by_kind_s"].keys()
    a, b = first["exposed_by_kind_s"], second["exposed_by_kind_s"]
    out["exposed_by_kind_s"] = {k: a.get(k, 0.0) + times * (b.get(k, 0.0) - a.get(k, 0.0)) for k in sorted(kinds)}
    return out


def _on_line(a, b, times: float):
    """The point `times` past `a` on the line through `a` and `b`, element-wise for lists."""
    if isinstance(a, list):
        return [x + times * (y - x) for x, y in zip(a, b, strict=True)]
    return a + times * (b - a)
