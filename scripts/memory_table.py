"""Estimated per-rank memory of the paper-scale configs: DDP against every SDP variant.

    python scripts/memory_table.py [--models llama_1b ...] [--world-size 8] [--jobs 2]
                                   [--out results/tables/memory_estimates]

Runs the GPU-free estimator (`sdp.estimate`: the run's own training step under
FakeTensorMode, one rank of a K-worker job) for every model x {DDP, SDP
backward, SDP forward} x {neuron, block} x C in {0.25, 0.5, 0.75}, on the
rank that holds the most, and writes OUT.md and OUT.csv. For LLaMA 500M and 1B
it adds the rows stacked with activation checkpointing (AC, per block), bf16
mixed precision and FSDP2: the DDP + AC and FSDP baselines, SDP forward
masking + AC (+ bf16), and SDP forward masking (neuron and block level) x
FSDP2 on K x F ranks. Each row is what that rank allocates: live-tensor peak
of a steady-state step and its split, and the static weights + gradients +
optimizer state, with reductions against DDP.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

GIB = 2**30
COVERAGES = (0.25, 0.5, 0.75)
# Each model on its paper dataset; per-rank batch as a typical run would use it.
MODELS = {
    "llama_134m": ["dataset=fineweb", "dataset.seq_len=1024", "trainer.global_batch_size=64"],
    "llama_500m": ["dataset=fineweb", "dataset.seq_len=1024", "trainer.global_batch_size=64"],
    "llama_1b": ["dataset=fineweb", "dataset.seq_len=1024", "trainer.global_batch_size=64"],
    "resnet18": ["dataset=cifar10", "trainer.global_batch_size=1024"],
    "swin_t": ["dataset=cifar10", "trainer.global_batch_size=1024"],
}
VARIANTS = [("DDP", "none", None)] + [
    (f"{'N' if gran == 'neuron' else 'B'}-SDP {mode}", mode, gran)
    for gran in ("neuron", "block")
    for mode in ("backward", "forward")
]
# Stacked with memory-saving methods (LLaMA 500M and 1B): label, coverage, overrides.
AC, BF16, FSDP = "parallelism.activation_checkpointing=full", "parallelism.mixed_precision=bf16", "parallelism=fsdp"
STACKED = [
    ("DDP + AC", 1.0, [AC]),
    ("DDP + AC + bf16", 1.0, [AC, BF16]),
    ("FSDP", 1.0, [FSDP]),
    ("FSDP + AC", 1.0, [FSDP, AC]),
    ("FSDP + AC + bf16", 1.0, [FSDP, AC, BF16]),
] + [
    (f"{g[0].upper()}-SDP forward + AC{' + bf16' if bf16 else ''}", c, [f"masking.granularity={g}", AC, *bf16])
    for g in ("neuron", "block")
    for c in (0.25, 0.5)
    for bf16 in ([], [BF16])
]
# SDP x FSDP: K SDP workers of F ranks each (K x F ranks, the same 8 x 1024 tokens per rank):
# F = 4 with and without bf16 at C = 0.25 and 0.5, and F = 8 for the most stacked setting.
SHARDED = [
    (
        f"{g[0].upper()}-SDP forward x FSDP(F={f}) + AC{' + bf16' if bf16 else ''}",
        c,
        f,
        [f"masking.granularity={g}", AC, *bf16],
    )
    for g in ("neuron", "block")
    for f, c, bf16 in [(4, c, bf16) for c in (0.25, 0.5) for bf16 in ([], [BF16])] + [(8, 0.25, [BF16])]
]
STACKED_MODELS = ("llama_500m", "llama_1b")


def _rows_for_model(model: str, world_size: int) -> list[dict]:
    """Every variant of one model, estimated in this (worker) process."""
    from sdp.errors import ConfigError
    from sdp.planning.estimator import EstimateError, estimate
    from sdp.planning.ranks import busiest_rank
    from sdp.run.config import load_config

    base = [f"model={model}", *MODELS[model]]
    rows = []
    for label, mode, gran in VARIANTS:
        for coverage in (1.0,) if mode == "none" else COVERAGES:
            overrides = base + [f"masking={mode}"]
            if mode != "none":
                overrides += [f"masking.granularity={gran}", f"masking.coverage={coverage}"]
            row = {"model": model, "variant": label, "coverage": coverage, "world_size": world_size}
            try:
                cfg = load_config(overrides, world_size=world_size, offline=True, check_data=False)
                rank = busiest_rank(cfg, world_size=world_size)
                row.update(est=estimate(cfg, world_size=world_size, rank=rank).to_json())
            except (ConfigError, EstimateError) as err:
                row.update(error=str(err))
            print(f"{model:>11} {label:<16} C={coverage:<4} {'ok' if 'est' in row else row['error']}", flush=True)
            rows.append(row)
    if model in STACKED_MODELS:
        for label, coverage, f, extra in SHARDED:
            row = {"model": model, "variant": label, "coverage": coverage, "world_size": world_size * f}
            overrides = base + [
                "masking=forward",
                f"masking.coverage={coverage}",
                "parallelism=fsdp",
                f"parallelism.fsdp_degree={f}",
                "trainer.global_batch_size=" + str(64 * f),
                *extra,
            ]
            try:
                cfg = load_config(overrides, world_size=world_size * f, offline=True, check_data=False)
                busiest = busiest_rank(cfg, world_size=world_size * f)
                row.update(est=estimate(cfg, world_size=world_size * f, rank=busiest).to_json())
            except (ConfigError, EstimateError) as err:
                row.update(error=str(err))
            print(f"{model:>11} {label:<36} C={coverage:<4} {'ok' if 'est' in row else row['error']}", flush=True)
            rows.append(row)
        for label, coverage, extra in STACKED:
            masking = ["masking=none"] if coverage == 1.0 else ["masking=forward", f"masking.coverage={coverage}"]
            row = {"model": model, "variant": label, "coverage": coverage, "world_size": world_size}
            try:
                cfg = load_config(base + masking + extra, world_size=world_size, offline=True, check_data=False)
                busiest = busiest_rank(cfg, world_size=world_size)
                row.update(est=estimate(cfg, world_size=world_size, rank=busiest).to_json())
            except (ConfigError, EstimateError) as err:
                row.update(error=str(err))
            print(f"{model:>11} {label:<26} C={coverage:<4} {'ok' if 'est' in row else row['error']}", flush=True)
            rows.append(row)
    return rows


def _flat(row: dict, ddp: dict | None) -> dict:
    """One CSV/markdown record, GiB and ratios to the model's DDP row."""
    out = {k: row[k] for k in ("model", "variant", "coverage", "world_size")}
    if "est" not in row:
        return {**out, "note": row["error"]}
    est, mem = row["est"], row["est"]["memory"]
    static = mem["params_bytes"] + mem["grads_bytes"] + mem["optim_bytes"]
    out.update(
        rank=est["rank"],
        micro_batch=est["micro_batch"],
        seq_len=est["seq_len"] or "",
        peak_gib=round(mem["peak_bytes"] / GIB, 3),
        **{f"peak_{k}_gib": round(v / GIB, 3) for k, v in mem["peak_breakdown"].items() if k != "total"},
        static_gib=round(static / GIB, 3),
        comm_groups=mem["comm_groups"],
        peak_with_comm_gib=round(mem["peak_with_comm_groups_bytes"] / GIB, 3),
        tflop_per_step=round(est["flops_per_step"] / 1e12, 3),
        comm_gib_per_step=round(est["comm_bytes_per_step"] / GIB, 3),
        note="",
    )
    if ddp is not None and "est" in ddp:
        dmem = ddp["est"]["memory"]
        dstatic = dmem["params_bytes"] + dmem["grads_bytes"] + dmem["optim_bytes"]
        out["peak_vs_ddp"] = f"{mem['peak_bytes'] / dmem['peak_bytes'] - 1:+.1%}"
        out["static_vs_ddp"] = f"{static / dstatic - 1:+.1%}"
    return out


COLUMNS = [
    ("model", "model"),
    ("variant", "variant"),
    ("coverage", "C"),
    ("rank", "rank"),
    ("peak_gib", "peak GiB"),
    ("peak_vs_ddp", "peak vs DDP"),
    ("static_gib", "params+grads+optim GiB"),
    ("static_vs_ddp", "static vs DDP"),
    ("peak_weights_gib", "weights"),
    ("peak_grads_gib", "grads"),
    ("peak_optimizer_gib", "optim"),
    ("peak_activations_gib", "acts"),
    ("peak_temporaries_gib", "temps"),
    ("comm_groups", "NCCL groups"),
    ("peak_with_comm_gib", "peak + communicators GiB"),
    ("tflop_per_step", "TFLOP/step"),
    ("comm_gib_per_step", "comm GiB/step"),
    ("note", "note"),
]


def markdown(records: list[dict], *, world_size: int, seconds: float) -> str:
    head = [
        "# Estimated per-rank memory: DDP vs SDP",
        "",
        f"Generated by `python scripts/memory_table.py --world-size {world_size}` (`make memory-table`) "
        f"in {seconds / 60:.1f} min on a CPU: each row is one rank of a K = {world_size} job traced by "
        "`python -m sdp.estimate` (the run's own step under FakeTensorMode, fp32, AdamW as the run builds it "
        "on CUDA: `optim.implementation=auto`), on the rank "
        "holding the most units. *peak* is the live-tensor peak of a steady-state step, split into "
        "weights / grads / optimizer state / activations / temporaries at that moment; *static* is "
        "weights + gradients + optimizer state. Reductions are against the same model's DDP row. "
        "LLaMA: FineWeb shapes, 8 x 1024 tokens per rank; ResNet-18 and Swin-T: CIFAR-10, 128 images per rank. "
        "AC: activation checkpointing of every block; bf16: bf16 compute with fp32 weights and optimizer state; "
        "FSDP: FSDP2 over the K ranks; SDP x FSDP(F): K = 8 SDP workers of F ranks each (world K x F, the same "
        "tokens per rank; *rank* is a global rank). "
        "*NCCL groups*: the process groups the rank joins (the world included), each an NCCL communicator; "
        "*peak + communicators* adds 688 MiB for each (`parallelism.comm_group_overhead_mb`, NVIDIA/nccl#964). "
        "A CUDA run adds the caching allocator's rounding and fragmentation on top (see `max_memory_reserved`).",
        "",
        "| " + " | ".join(title for _, title in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    body = ["| " + " | ".join(str(r.get(key, "")) for key, _ in COLUMNS) + " |" for r in records]
    return "\n".join(head + body) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out", type=Path, default=Path("results/tables/memory_estimates"))
    args = parser.parse_args()
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        per_model = list(pool.map(_rows_for_model, args.models, [args.world_size] * len(args.models)))
    records = []
    for rows in per_model:
        ddp = rows[0]
        records += [_flat(row, ddp) for row in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(
        markdown(records, world_size=args.world_size, seconds=time.perf_counter() - start)
    )
    keys = [key for key, _ in COLUMNS] + ["micro_batch", "seq_len", "world_size"]
    with args.out.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(records)
    print(f"wrote {args.out.with_suffix('.md')} and .csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
