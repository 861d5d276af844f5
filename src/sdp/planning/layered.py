"""The planner's estimate of a run: two small traces and a line, for a model of identical layers.

A LLaMA's decoder layers are identical, so at a fixed micro-batch every figure the estimator
counts (parameters, gradients and optimizer state, each part of the live peak, FLOPs, bytes
sent) is affine in the number of layers L: the embedding, head and loss once, each layer the
same again. `layered_estimate` traces the run with 1 and 2 layers and extends the line to L.
Measured on this machine for `llama_1b` (24 layers, sequences of 1024): under DDP with K = 8
the line's peak is the whole trace's to the byte at micro-batches 1 to 16; under N-SDP
forward at C = 0.5 with K = 4, within 0.01% on ranks 0 and 3 (a worker's units differ by one
from layer to layer), in 0.9 s against 4.4 to 5.6 s for the whole trace.
tests/test_plan_layered.py checks that tiny LLaMAs' figures are equal.

What the line cannot carry is traced whole: models whose layers differ (ResNet, Swin), and
block-level SDP, whose mask (which blocks a worker holds) depends on how many blocks there
are. The process groups a rank joins are the short traces' (a neuron mask has the same
holder sets at any depth); the collective timeline is not extended (`timeline` is None).
"""

from __future__ import annotations

import dataclasses

from sdp.planning.estimator import estimate
from sdp.run.config import RunConfig
from sdp.subnet import is_sdp

SHORT = (1, 2)  # the depths traced


def extends(cfg: RunConfig) -> bool:
    """Whether `cfg`'s estimate is affine in its number of layers (see the module doc)."""
    block_sdp = is_sdp(cfg.masking.name) and cfg.masking.granularity == "block"
    return cfg.model.family == "llama" and not block_sdp and cfg.model.num_layers > max(SHORT)


def with_layers(cfg: RunConfig, layers: int) -> RunConfig:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=layers))


def layered_estimate(cfg: RunConfig, *, world_size: int, rank: int) -> dict:
    """`sdp.planning.estimator.estimate`'s figures for `rank`, from two short traces when the
    model allows (`method` says which); the whole trace otherwise."""
    if not extends(cfg):
        return {**estimate(cfg, world_size=world_size, rank=rank), "method": "traced"}
    one, two = (estimate(with_layers(cfg, n), world_size=world_size, rank=rank) for n in SHORT)
    layers = cfg.model.num_layers

    def line(a: float, b: float) -> int:
        return round(a + (layers - SHORT[0]) * (b - a))

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
        "trace_s": round(one["trace_s"] + two["trace_s"], 2),
        "method": f"layers {SHORT[0]} and {SHORT[1]}, extended to {layers}",
    }
