"""The planner's estimate of a run: two small traces and a line, for a model of identical layers.

A LLaMA's decoder layers are identical, so at a fixed micro-batch every figure the estimator
counts (parameters, gradients and optimizer state, each part of the live peak, FLOPs, bytes
sent) is affine in the number of layers L: the embedding, head and loss once, each layer the
same again, once the depth is past the point where the step's peak moment settles.
`layered_estimate` traces the run with 3 and 4 layers and extends the line to L. The peak is
the largest of several moments of the step, each affine in depth (the loss with every layer's
saved activations, a layer's backward, the optimizer step), so the line is exact while the
moment that peaks at 3 and 4 layers still peaks at L. Measured for llama_1b (24 layers, K = 8,
micro-batch 8, 2 accumulation steps; docs/plan.md has the table): through 1 and 2 layers the
line is 14% under the whole trace for N-SDP backward C=0.25 + bf16, through 2 and 3 6.9% under
for N-SDP forward C=0.25 + selective AC, through 3 and 4 within 0.006% on six configurations,
but 6.6% under for N-SDP forward C=0.75 + full AC + bf16, whose peak moment changes past 6
layers. The planner therefore traces its top row whole before printing it (`sdp.plan`), and
`scripts/plan_check.py` checks any plan's rows against whole traces.
tests/test_plan_layered.py checks that 6-layer tiny LLaMAs' figures are equal.

What the line cannot carry is traced whole: models whose layers differ (ResNet, Swin), and
block-level SDP, whose mask (which blocks a worker holds) depends on how many blocks there
are. The process groups a rank joins are the short traces' (a neuron mask has the same
holder sets at any depth). The collective timeline is not extended (`timeline` is None): with
a cluster, the step-time model runs on each short trace and its seconds are extended the same
way (`step`): within 0.01% of the whole trace's overlapped step for llama_1b on h100_nvlink
and 0.5% on 2 nodes of h100_ib, for the configurations above.
"""

from __future__ import annotations

import dataclasses

from sdp.planning.estimator import estimate
from sdp.planning.step_time import Cluster, step_times
from sdp.run.config import RunConfig
from sdp.subnet import is_sdp

SHORT = (3, 4)  # the depths traced (shallower models peak elsewhere: see the module doc)


def extends(cfg: RunConfig) -> bool:
    """Whether `cfg`'s estimate is affine in its number of layers (see the module doc)."""
    block_sdp = is_sdp(cfg.masking.name) and cfg.masking.granularity == "block"
    return cfg.model.family == "llama" and not block_sdp and cfg.model.num_layers > max(SHORT)


def with_layers(cfg: RunConfig, layers: int) -> RunConfig:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=layers))


def layered_estimate(cfg: RunConfig, *, world_size: int, rank: int, cluster: Cluster | None = None) -> dict:
    """`sdp.planning.estimator.estimate`'s figures for `rank`, from two short traces when the
    model allows (`method` says which); the whole trace otherwise. With a cluster, `step` holds
    `step_times` on it (None without)."""
    if not extends(cfg):
        whole = estimate(cfg, world_size=world_size, rank=rank)
        return {**whole, "method": "traced", "step": None if cluster is None else step_times(whole, cluster)}
    one, two = (estimate(with_layers(cfg, n), world_size=world_size, rank=rank) for n in SHORT)
    layers = cfg.model.num_layers

    def line(a: float, b: float) -> int:
        return round(a + (layers - SHORT[0]) * (b - a))

    step = None
    if cluster is not None:
        step = extend_steps(step_times(one, cluster), step_times(two, cluster), layers - SHORT[0])

    mem1, mem2 = one["memory"], two["memory"]
    memory = dict(mem2)
    for key in ("params_bytes", "grads_bytes", "optim_bytes"):
        memory[key] = line(mem1[key], mem2[key])
    breakdown = {k: line(v, mem2["peak_breakdown"][k]) for k, v in mem1["peak_breakdown"].items() if k != "total"}
    breakdown["total"] = sum(breakdown.values())
    memory |= {"peak_bytes": breakdown["total"], "peak_breakdown": breakdown}
    memory["peak_with_comm_groups_bytes"] = breakdown["total"] + memory["comm_group_bytes"]
    return {
        **two,
        "memory": memory,
        "n_params": line(one["n_params"], two["n_params"]),
        "flops_per_step": line(one["flops_per_step"], two["flops_per_step"]),
        "comm_bytes_per_step": line(one["comm_bytes_per_step"], two["comm_bytes_per_step"]),
        "comm_bytes_per_step_by_kind": {
            k: line(v, two["comm_bytes_per_step_by_kind"][k]) for k, v in one["comm_bytes_per_step_by_kind"].items()
        },
        "timeline": None,
        "step": step,
        "trace_s": round(one["trace_s"] + two["trace_s"], 2),
        "method": f"layers {SHORT[0]} and {SHORT[1]}, extended to {layers}",
    }


def extend_steps(first: dict, second: dict, times: float) -> dict:
    """`step_times` figures on the line through `first` and `second`, `times` steps past `first`
    (each second, and each kind's exposed seconds)."""
    out = {k: v + times * (second[k] - v) for k, v in first.items() if k != "exposed_by_kind_s"}
    kinds = first["exposed_by_kind_s"].keys() | second["exposed_by_kind_s"].keys()
    a, b = first["exposed_by_kind_s"], second["exposed_by_kind_s"]
    out["exposed_by_kind_s"] = {k: a.get(k, 0.0) + times * (b.get(k, 0.0) - a.get(k, 0.0)) for k in sorted(kinds)}
    return out
