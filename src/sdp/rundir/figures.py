"""The end-of-run figures of summary.json that need every rank: memory and communication as
the busiest rank's, FLOPs, throughput and step times, MFU. The loop's components hand over
what they measured (the meter its clocks and probes, the counter its bytes); these functions
turn it into `Summary` fields."""

from __future__ import annotations

import torch
from torch import nn

from sdp import dist
from sdp.metrics.comm import CommCounter, exposed_comm
from sdp.metrics.flops import attention_heads, model_flops_per_token, peak_entry
from sdp.metrics.memory import cuda_peaks
from sdp.parallel import Strategy


def speed(*, seconds: float, steps: int, phases: dict[str, float], units_per_step: int, world_size: int) -> dict:
    """Throughput and step times from `steps` timed steps that took `seconds`, `phases` the
    seconds per phase over them (per rank: its share of the global batch)."""
    step_time = seconds / steps if steps else None
    return {
        "tokens_or_samples_per_s": units_per_step / step_time if step_time else None,
        "tokens_or_samples_per_s_per_rank": units_per_step / world_size / step_time if step_time else None,
        "step_time_s": step_time,
        "step_time_split_s": {k: v / steps for k, v in phases.items()} if steps else {},
    }


def measurements(
    strategy: Strategy, comm: CommCounter, *, memory: dict, peak: dict | None, flops: int | None, device: torch.device
) -> dict:
    """Collective: the memory, FLOP and communication entries, from every rank's."""
    local = {
        **memory,
        "peak_bytes": peak["total"] if peak else None,
        "peak_breakdown": peak,
        **cuda_peaks(device),
    }
    gathered = dist.gather_objects((local, flops, comm.waits(), sum(comm.per_step().values())))
    per_rank = [mem for mem, _, _, _ in gathered]
    return {
        "flops_per_step_per_rank": max((f for _, f, _, _ in gathered if f is not None), default=None),
        "memory": _busiest(per_rank),
        "memory_per_rank": per_rank,
        **_comm_summary(comm, strategy, [w for _, _, w, _ in gathered], device=device),
        # Each rank's bytes sent per step (ranks of different capacities send different amounts).
        "comm_bytes_per_step_per_rank": [sent for _, _, _, sent in gathered],
    }


def mfu_entries(
    strategy: Strategy,
    *,
    device: torch.device,
    precision: str,
    flops: int | None,
    step_time: float | None,
    tokens_per_rank: int,
    seq_len: int,
) -> dict:
    """The MFU entries: the FLOPs a step of this rank is credited with (a
    transformer's model FLOPs by torchtitan's formula for what this rank runs, see
    metrics.flops.model_flops_per_token; other models' FLOPs as counted in the profiled step)
    over its step time and the peak-table entry of the device (`mfu_peak`; null on CPU or an
    unlisted device, and then `mfu` is null too)."""
    peak = peak_entry(device, precision)
    out = {"mfu": None, "mfu_peak": peak, "mfu_flops": None, "mfu_flops_per_step": None}
    heads, head_dim = attention_heads(strategy.model)
    if heads:
        trainable = strategy.trainable()
        embeddings = [m.weight for m in strategy.model.modules() if isinstance(m, nn.Embedding)]
        embedding = sum(w.numel() for w in embeddings)
        trained = sum(p.numel() for p in trainable) - sum(
            w.numel() for w in embeddings if any(w is p for p in trainable)
        )
        per_token = model_flops_per_token(
            forward_params=strategy.forward_params() - embedding,
            trained_params=trained,
            heads=heads,
            head_dim=head_dim,
            seq_len=seq_len,
        )
        out["mfu_flops"], out["mfu_flops_per_step"] = "model (torchtitan)", per_token * tokens_per_rank
    elif flops:
        out["mfu_flops"], out["mfu_flops_per_step"] = "counted", flops
    if peak and step_time and out["mfu_flops_per_step"]:
        out["mfu"] = out["mfu_flops_per_step"] / step_time / peak["flops_per_s"]
    return out


def _comm_summary(comm: CommCounter, strategy: Strategy, waits: list, *, device: torch.device) -> dict:
    """The communication entries, from every rank's counter (collective); `waits`
    is every rank's `comm.waits()`."""
    per_step = comm.per_step()
    counters = {**per_step, "total": sum(per_step.values()), "comm_groups": strategy.comm_groups()}
    busiest = _max_over_ranks(counters, device=device)
    exposed, waited = exposed_comm(waits)
    return {
        # The busiest rank's total, and each kind's busiest rank (not necessarily the same one).
        "comm_bytes_per_step": busiest.pop("total"),
        # The busiest rank's process groups (with NCCL, communicators), the world included.
        "comm_groups_per_rank": int(busiest.pop("comm_groups")),
        "comm_bytes_per_step_by_kind": busiest,
        # Waiting for gradient averaging and weight refresh after the compute, mean s per step:
        # the part no rank could hide, and the busiest rank's, peers' drift included (see
        # metrics.comm.exposed_comm; None where not measured: FSDP waits inside its own hooks).
        "exposed_comm_s": exposed,
        "comm_wait_s": waited,
    }


def _busiest(per_rank: list[dict]) -> dict:
    """Each memory counter's largest value over the ranks, and the peak breakdown of the rank
    with the largest live peak."""
    out = {}
    for key in per_rank[0]:
        if key == "peak_breakdown":
            continue
        values = [r[key] for r in per_rank if r[key] is not None]
        out[key] = max(values) if values else None
    with_peak = [r for r in per_rank if r["peak_breakdown"] is not None]
    out["peak_breakdown"] = max(with_peak, key=lambda r: r["peak_bytes"])["peak_breakdown"] if with_peak else None
    return out


def _max_over_ranks(values: dict[str, float], *, device: torch.device) -> dict[str, float]:
    """Each counter's largest value over the ranks: what the busiest device holds or sends.

    Every rank must pass the same keys.
    """
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce_(t, op="max")
    return dict(zip(keys, t.tolist(), strict=True))
