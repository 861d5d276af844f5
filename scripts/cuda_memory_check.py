"""Real CUDA memory and speed of one rank of a K-worker job on one GPU, against the estimator.

    python scripts/cuda_memory_check.py [--models llama_134m ...] [--world-size 8] [--steps 10] [--out DIR]

For DDP and each SDP variant (C = 0.5), this process plays the rank that holds
the most units in a K-worker job: the run's strategy, optimizer and
`train_step` on real CUDA tensors, with a fake process group (collectives
move nothing, so the step time is compute only). It reads the CUDA
allocator's peaks over a steady-state step, the live-tensor tracker's peak on
the same step, and tokens/s over `--steps` more steps; then it runs the
GPU-free estimator (`sdp.estimate`) on the same config and reports the ratio, in total and per
category (`sdp.planning.against`, the table `sdp.estimate --against RUN_DIR` prints for a run).
Results go to DIR/cuda_memory_check.json and .md after every variant, so a
run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from sdp import dist
from sdp.metrics.comm import CommCounter
from sdp.metrics.flops import peak_flops
from sdp.optim import build_optimizer
from sdp.planning.against import compare, format_against
from sdp.planning.estimator import dummy_batch, estimate
from sdp.planning.ranks import busiest_rank
from sdp.run.build import build_strategy
from sdp.run.config import load_config
from sdp.run.measure import PhaseTimer, count_flops, measure_peak
from sdp.run.trainer import train_step
from sdp.run.trainer_config import micro_batch_size

GIB = 2**30
BASE = ["dataset=fineweb", "dataset.seq_len=1024", "trainer.global_batch_size=64"]
VARIANTS = {
    "DDP": ["masking=none"],
    "N-SDP backward": ["masking=backward", "masking.coverage=0.5"],
    "N-SDP forward": ["masking=forward", "masking.coverage=0.5"],
    "B-SDP backward": ["masking=backward", "masking.granularity=block", "masking.coverage=0.5"],
    "B-SDP forward": ["masking=forward", "masking.granularity=block", "masking.coverage=0.5"],
    # Stacked with activation checkpointing (AC), bf16 and FSDP2 (over the K ranks).
    "DDP + AC": ["masking=none", "parallelism.activation_checkpointing=full"],
    "FSDP + AC + bf16": [
        "masking=none",
        "parallelism=fsdp",
        "parallelism.activation_checkpointing=full",
        "parallelism.mixed_precision=bf16",
    ],
    "B-SDP forward C=0.25 + AC + bf16": [
        "masking=forward",
        "masking.granularity=block",
        "masking.coverage=0.25",
        "parallelism.activation_checkpointing=full",
        "parallelism.mixed_precision=bf16",
    ],
}


def measure(cfg, *, world_size: int, rank: int, device: torch.device, steps: int) -> dict:
    """Peaks of one steady-state step (step 3) and the speed of `steps` more, on `device`."""
    # No NaN check, as in the estimator it is compared with (a scalar: nothing to measure).
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, on_nonfinite="off"))
    micro = micro_batch_size(cfg.trainer, world_size=world_size)
    world = dist.World(rank=rank, local_rank=0, world_size=world_size)
    with dist.fake_process_group(rank, world_size):
        strategy = build_strategy(cfg, world=world, device=device, comm=CommCounter())
        optimizer = build_optimizer(strategy.trainable(), cfg.optim, device=device)
        batches = itertools.repeat(dummy_batch(cfg, micro))
        timer = PhaseTimer(device)

        def run_step():
            return train_step(strategy, optimizer, batches, cfg=cfg.trainer, micro=micro, device=device, timer=timer)

        strategy.model.train()
        run_step()
        _, flops = count_flops(run_step)
        static = strategy.memory(optimizer)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _, peak = measure_peak(strategy, optimizer, run_step)
        _sync(device)
        out = {"static": static, "tracked_peak": peak, "flops_per_step": flops}
        if device.type == "cuda":
            out["cuda_max_allocated_probe"] = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for _ in range(steps):
            run_step()
        _sync(device)
        step_s = (time.perf_counter() - start) / steps
        if device.type == "cuda":
            out["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device)
            out["cuda_max_reserved"] = torch.cuda.max_memory_reserved(device)
        out["step_s"] = step_s
        out["tokens_per_s"] = micro * cfg.dataset.seq_len / step_s
        top = peak_flops(device, cfg.parallelism.mixed_precision)
        out["mfu"] = flops / step_s / top if top else None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def table(rows: list[dict]) -> str:
    lines = [
        "| model | variant | rank | CUDA max allocated GiB | vs DDP | CUDA max reserved GiB | tracked peak GiB "
        "| estimated peak GiB | estimate / CUDA | static GiB | tokens/s (compute only) | MFU fp32 |",
        "|" + "---|" * 12,
    ]
    ddp = {}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['variant']} | | error: {r['error']} |" + " |" * 8)
            continue
        m, e = r["measured"], r.get("estimate")
        est = e["memory"]["peak_bytes"] if e else None
        alloc = m.get("cuda_max_allocated", m["tracked_peak"]["total"])
        if r["variant"] == "DDP":
            ddp[r["model"]] = alloc
        base = ddp.get(r["model"])
        static = sum(m["static"].values())
        mfu = "" if m["mfu"] is None else f"{m['mfu']:.1%}"
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['rank']} | {alloc / GIB:.2f} | "
            f"{'' if not base else f'{alloc / base - 1:+.1%}'} | {m.get('cuda_max_reserved', 0) / GIB:.2f} | "
            f"{m['tracked_peak']['total'] / GIB:.2f} | {f'{est / GIB:.2f}' if e else ''} | "
            f"{f'{est / alloc:.3f}' if e else ''} | {static / GIB:.2f} | {m['tokens_per_s']:.0f} | {mfu} |"
        )
    return "\n".join(lines) + "\n"


def by_category(rows: list[dict]) -> str:
    """Each estimated row's figures per category against its measurement: the categories are the
    live-tensor tracker's, the total the allocator's on CUDA (the tracker's on CPU)."""
    parts = []
    for r in rows:
        if "error" not in r and r.get("estimate"):
            m = r["measured"]
            against = compare(r["rank"], r["estimate"]["memory"], m["tracked_peak"], m.get("cuda_max_allocated"))
            parts.append(f"### {r['model']}, {r['variant']}\n\n```\n{format_against([against])}\n```\n")
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama_134m"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS)[:5], choices=list(VARIANTS))
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--extra", nargs="*", default=[], help="more overrides, e.g. trainer.global_batch_size=16")
    parser.add_argument("--out", type=Path, default=Path("outputs/cuda_memory_check"))
    parser.add_argument("--no-estimate", action="store_true", help="skip the estimator (run it on a CPU later)")
    parser.add_argument(
        "--append", action="store_true", help="add to DIR's results (one process per variant: nothing carries over)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "cuda_memory_check.json"
    rows = json.loads(saved.read_text())["rows"] if args.append and saved.exists() else []
    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    print(info, flush=True)
    for model, variant in itertools.product(args.models, args.variants):
        row = {"model": model, "variant": variant, "world_size": args.world_size}
        try:
            overrides = [f"model={model}", *BASE, *VARIANTS[variant], *args.extra]
            cfg = load_config(overrides, world_size=args.world_size, offline=True, check_data=False)
            row["rank"] = busiest_rank(cfg, world_size=args.world_size)
            row["measured"] = measure(
                cfg, world_size=args.world_size, rank=row["rank"], device=device, steps=args.steps
            )
            if not args.no_estimate:
                est = estimate(cfg, world_size=args.world_size, rank=row["rank"], target=device.type)
                row["estimate"] = est.to_json()
        except Exception as err:  # noqa: BLE001  (one variant failing must not lose the others)
            traceback.print_exc()
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        rows.append(row)
        print(json.dumps(row)[:600], flush=True)
        (args.out / "cuda_memory_check.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
        (args.out / "cuda_memory_check.md").write_text(f"{info}\n\n" + table(rows) + "\n" + by_category(rows))
    print(table(rows))
    print(by_category(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
