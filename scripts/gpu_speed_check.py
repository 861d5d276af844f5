"""Tokens/s, MFU and CUDA peak of one rank of a K-worker job on one GPU, eager and compiled,
with the full and the chunked loss, against the estimator's peak.

    python scripts/gpu_speed_check.py [--models llama_134m llama_1b] [--world-size 8] [--steps 8]
                                      [--losses full chunked] [--compile no yes]
                                      [--budget-min 7.5] [--out results/bench] [--smoke]

For llama_134m and llama_1b in bf16 and DDP, FSDP + AC, N-SDP forward, B-SDP forward and
N-SDP backward (C = 0.5), each eager and compiled (`parallelism.compile`) and with
`model.loss=full` and `chunked`, this process plays the busiest rank of the job: the run's
strategy, fused optimizer, device-side NaN/Inf guard, prefetched batches and `train_step` on
real CUDA tensors,
with a fake process group (collectives move nothing: compute only, as
`cuda_memory_check.py`). Per configuration: two warm-up steps (compilation), then `--steps`
timed ones, bracketed by one device sync, with CUDA's sync debug mode counting the host
synchronisations inside them (the steady state should have none). It reports tokens/s, MFU
(torchtitan's model FLOPs, summary.json's `mfu`), the phases (CUDA events), the CUDA peak
and the estimator's, and checks the targets: llama_1b DDP + compile >= 40% MFU, every SDP
variant's MFU >= DDP's (same compile and loss), forward masking's tokens/s > DDP's.

Results go to OUT/gpu_speed_<device>.md and .json after every configuration; past
`--budget-min` no new one starts, so a run cut short keeps what it measured. `--smoke`
rehearses it on the CPU with the tiny LLaMA, two configurations and two steps (the test suite
runs it).
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
import warnings
from pathlib import Path

import torch

from sdp import dist
from sdp.data.prefetch import to_device
from sdp.metrics.comm import CommCounter
from sdp.optim import build_optimizer
from sdp.planning.estimator import dummy_batch, estimate
from sdp.planning.ranks import busiest_rank
from sdp.run.build import build_strategy
from sdp.run.config import load_config
from sdp.run.measure import PhaseTimer
from sdp.run.nonfinite import NonFiniteGuard, skips_on_device
from sdp.run.trainer import train_step
from sdp.run.trainer_config import micro_batch_size
from sdp.rundir.figures import mfu_entries

GIB = 2**30
BASE = ["dataset=fineweb", "dataset.seq_len=1024", "trainer.global_batch_size=64", "parallelism.mixed_precision=bf16"]
AC = "parallelism.activation_checkpointing=full"
VARIANTS = {
    "DDP": ["masking=none"],
    "FSDP + AC": ["masking=none", "parallelism=fsdp", AC],
    "N-SDP forward": ["masking=forward", "masking.coverage=0.5"],
    "B-SDP forward": ["masking=forward", "masking.granularity=block", "masking.coverage=0.5"],
    "N-SDP backward": ["masking=backward", "masking.coverage=0.5"],
}
SMOKE = ["dataset=synthetic_text", "dataset.seq_len=32", "trainer.global_batch_size=8"]
MFU_TARGET = 0.40  # llama_1b DDP bf16 + compile (OLMo-core's 1B: 39-40% on H100)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(cfg, *, world_size: int, rank: int, device: torch.device, steps: int, warmup: int = 2) -> dict:
    """Speed and CUDA peak of `steps` steps of `rank`, after `warmup` (compiling) ones."""
    micro = micro_batch_size(cfg.trainer, world_size=world_size)
    world = dist.World(rank=rank, local_rank=0, world_size=world_size)
    with dist.fake_process_group(rank, world_size):
        strategy = build_strategy(cfg, world=world, device=device, comm=CommCounter())
        optimizer = build_optimizer(strategy.trainable(), cfg.optim, device=device)
        guard = None
        if skips_on_device(optimizer):  # as the trainer does: the NaN/Inf check on the device
            guard = NonFiniteGuard("stop", max_skips=0, device=device)
        else:  # Under the fake group a broadcast receives nothing: backward masking's weight
            # refresh leaves its receivers' buffers as allocated and the weights turn non-finite.
            # The device guard skips those steps, timed as the trainer runs it; the host check
            # (CPU, or a run CUDA's fused kernels refuse) would raise, so it is off.
            cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, on_nonfinite="off"))
        # The trainer's data path: pinned host batches copied a step ahead on a side stream.
        batches = to_device(itertools.repeat(dummy_batch(cfg, micro)), device)
        timer = PhaseTimer(device)

        def run_step():
            return train_step(
                strategy, optimizer, batches, cfg=cfg.trainer, micro=micro, device=device, timer=timer, guard=guard
            )

        strategy.model.train()
        start = time.perf_counter()
        for _ in range(warmup):
            run_step()
        _sync(device)
        warmup_s = time.perf_counter() - start
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.set_sync_debug_mode("warn")
        timer = PhaseTimer(device)
        with warnings.catch_warnings(record=True) as syncs:
            warnings.simplefilter("always")
            start = time.perf_counter()
            for _ in range(steps):
                run_step()
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
            _sync(device)
        step_s = (time.perf_counter() - start) / steps
        phases = {k: v / steps for k, v in timer.read().items()}
        tokens = micro * cfg.dataset.seq_len
        mfu = mfu_entries(
            strategy,
            device=device,
            precision="bf16",
            flops=None,
            step_time=step_s,
            tokens_per_rank=tokens,
            seq_len=cfg.dataset.seq_len,
        )
        out = {
            "step_s": step_s,
            "warmup_s": warmup_s,
            "tokens_per_s": tokens / step_s,
            "mfu": mfu["mfu"],
            "mfu_peak": mfu["mfu_peak"],
            "model_flops_per_step": mfu["mfu_flops_per_step"],
            "phases_s": phases,
            "host_syncs_per_step": sum("synchroniz" in str(w.message) for w in syncs) / steps,
            "cuda_max_allocated": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        }
        if guard is not None:
            assert not guard.report(), "a non-finite step in a speed check"
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def configurations(
    models: list[str], variants: list[str], *, smoke: bool, losses=("full", "chunked"), modes=(False, True)
):
    """(model, variant, compile, loss) in the order they run: eager before compiled."""
    for model, variant, compiled, loss in itertools.product(models, variants, modes, losses):
        if smoke and (loss == "full" or (compiled and variant != "DDP")):
            continue  # the rehearsal: DDP eager and compiled, chunked loss
        yield model, variant, compiled, loss


def checks(rows: list[dict]) -> list[str]:
    """The targets' verdicts, from the rows measured."""
    got = {(r["model"], r["variant"], r["compile"], r["loss"]): r["measured"] for r in rows if "measured" in r}
    out = []
    ddp = got.get(("llama_1b", "DDP", True, "chunked"))
    if ddp and ddp["mfu"] is not None:
        out.append(
            f"- llama_1b DDP + compile: MFU {ddp['mfu']:.1%} ({'ok' if ddp['mfu'] >= MFU_TARGET else 'missed'}: "
            f"target >= {MFU_TARGET:.0%})"
        )
    for (model, variant, compiled, loss), m in got.items():
        base = got.get((model, "DDP", compiled, loss))
        if variant in ("DDP", "FSDP + AC") or base is None or m["mfu"] is None or base["mfu"] is None:
            continue
        how = f"{'compiled' if compiled else 'eager'}, {loss}"
        line = f"- {model} {variant} ({how}): MFU {m['mfu']:.1%} vs DDP {base['mfu']:.1%}"
        line += f" ({'ok' if m['mfu'] >= base['mfu'] else 'missed'})"
        if "forward" in variant:
            ratio = m["tokens_per_s"] / base["tokens_per_s"]
            line += f"; tokens/s {ratio:.2f} x DDP ({'ok' if ratio > 1 else 'missed'}: target > 1)"
        out.append(line)
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| model | variant | compile | loss | tokens/s | MFU | step ms | fwd / bwd / sync / optim ms | host syncs/step "
        "| CUDA peak GiB | estimated GiB (eager) | warm-up s |",
        "|" + "---|" * 12,
    ]
    for r in rows:
        head = f"| {r['model']} | {r['variant']} | {'yes' if r['compile'] else 'no'} | {r['loss']} |"
        if "error" in r:
            lines.append(f"{head} error: {r['error']} |" + " |" * 7)
            continue
        m, est = r["measured"], r.get("estimated_peak")
        ph = m["phases_s"]
        split = " / ".join(f"{1e3 * ph.get(k, 0):.0f}" for k in ("forward", "backward", "sync", "optimizer"))
        mfu = "" if m["mfu"] is None else f"{m['mfu']:.1%}"
        peak = "" if m["cuda_max_allocated"] is None else f"{m['cuda_max_allocated'] / GIB:.2f}"
        lines.append(
            f"{head} {m['tokens_per_s']:.0f} | {mfu} | {1e3 * m['step_s']:.0f} | {split} "
            f"| {m['host_syncs_per_step']:.1f} | {peak} | {'' if est is None else f'{est / GIB:.2f}'} "
            f"| {m['warmup_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def run(args) -> list[dict]:
    device = torch.device("cpu" if args.smoke else args.device)
    name = torch.cuda.get_device_name(device).split()[-1].lower() if device.type == "cuda" else "cpu"
    out_md, out_json = args.out / f"gpu_speed_{name}.md", args.out / f"gpu_speed_{name}.json"
    models = ["llama_tiny"] if args.smoke else args.models
    base = SMOKE if args.smoke else BASE
    rows, estimates, start = [], {}, time.perf_counter()
    losses, modes = getattr(args, "losses", ("full", "chunked")), getattr(args, "compile", ("no", "yes"))
    chosen = configurations(models, args.variants, smoke=args.smoke, losses=losses, modes=[m == "yes" for m in modes])
    for model, variant, compiled, loss in chosen:
        if time.perf_counter() - start > 60 * args.budget_min:
            print(f"budget of {args.budget_min} min spent: {model} {variant} and later not run", flush=True)
            break
        row = {"model": model, "variant": variant, "compile": compiled, "loss": loss}
        overrides = [f"model={model}", *base, *VARIANTS[variant], f"parallelism.compile={str(compiled).lower()}"]
        overrides.append(f"model.loss={loss}")
        try:
            cfg = load_config(overrides, world_size=args.world_size, offline=True, check_data=False)
            cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, on_nonfinite="stop"))
            rank = busiest_rank(cfg, world_size=args.world_size)
            row["measured"] = measure(cfg, world_size=args.world_size, rank=rank, device=device, steps=args.steps)
            key = (model, variant, loss)  # the estimator traces the eager step: compile does not change it
            if not args.no_estimate and key not in estimates:
                estimates[key] = estimate(cfg, world_size=args.world_size, rank=rank).memory["peak_bytes"]
            row["estimated_peak"] = estimates.get(key)
        except Exception as err:  # noqa: BLE001  (one configuration failing must not lose the others)
            traceback.print_exc()
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        rows.append(row)
        print(json.dumps(row)[:400], flush=True)
        report = f"{table(rows)}\n" + "\n".join(checks(rows)) + "\n"
        args.out.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": rows}, indent=1))
        out_md.write_text(
            f"# Speed of one rank on {name} ({torch.__version__}, world size {args.world_size})\n\n" + report
        )
    print(out_md.read_text() if rows else "nothing measured")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama_134m", "llama_1b"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--losses", nargs="+", default=["full", "chunked"], choices=["full", "chunked"])
    parser.add_argument("--compile", nargs="+", default=["no", "yes"], choices=["no", "yes"])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--budget-min", type=float, default=7.5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("results/bench"))
    parser.add_argument("--no-estimate", action="store_true", help="skip the estimator")
    parser.add_argument("--smoke", action="store_true", help="rehearse on the CPU: the tiny LLaMA, 2 steps")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.world_size, args.no_estimate = 2, 2, True
    rows = run(args)
    return 0 if rows and all("measured" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
