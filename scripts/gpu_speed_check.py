"""Tokens/s, MFU and CUDA peak of one rank of a K-worker job on one GPU, eager and compiled,
each configuration in a process of its own, beside the estimator's peak and modelled step.

    python scripts/gpu_speed_check.py [--plan results/plan/nvlink/plan.json] [--variants ...]
                                      [--compile no yes] [--steps 8] [--budget-min 7.5]
                                      [--out results/bench] [--smoke]

For llama_1b in bf16 with the chunked loss (the plan's run: `experiment=llama_1b_fineweb`, 256
tokens a sequence) at the planner's micro-batch (the plan's row of each variant, else DDP's), and
DDP, N-SDP forward and backward, B-SDP forward and backward (C = 0.5), each eager and compiled
(`parallelism.compile`), a child process plays the busiest rank: the run's strategy, fused
optimizer, device-side NaN/Inf guard, prefetched batches and `train_step` on real CUDA tensors,
with a fake process group (collectives move nothing: compute only, as `cuda_memory_check.py`).
A process each, so that no configuration's memory or compiled code is left to the next (the
first H200 run measured all in one process and B-SDP forward's peak came out above DDP's).
Per configuration: two warm-up steps (compilation), then `--steps` timed ones, bracketed by one
device sync, with CUDA's sync debug mode counting the host synchronisations inside them (the
steady state should have none). It reports tokens/s, MFU (torchtitan's model FLOPs,
summary.json's `mfu`), the phases (CUDA events) and the CUDA peak; beside them the estimator's
peak and its modelled step (`sdp.planning.step_time` on the device's cluster:
`h200_nvlink` or `h100_nvlink`), traced once per variant in this process before the children
start. Targets: N-SDP forward compiled >= 1.5 x DDP's tokens/s, B-SDP forward >= 1.7 x, N-SDP
backward >= 0.9 x; eager peaks within 5% of the estimate, compiled within 10%; modelled steps
within 15% of measured.

Results go to OUT/gpu_speed_<device>.md and .json after every configuration; past
`--budget-min` no new one starts, so a run cut short keeps what it measured. `--smoke`
rehearses it on the CPU with the tiny LLaMA, three configurations and two steps (the test suite
runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from sdp import dist
from sdp.data.prefetch import to_device
from sdp.metrics.comm import CommCounter
from sdp.optim import build_optimizer
from sdp.planning.estimator import dummy_batch, estimate
from sdp.planning.ranks import busiest_rank
from sdp.planning.step_time import load_cluster, step_times
from sdp.run.build import build_strategy
from sdp.run.config import load_config
from sdp.run.measure import PhaseTimer
from sdp.run.nonfinite import NonFiniteGuard, skips_on_device
from sdp.run.trainer import train_step
from sdp.run.trainer_config import micro_batch_size
from sdp.rundir.figures import mfu_entries

GIB = 2**30
BASE = ["parallelism.mixed_precision=bf16", "model.loss=chunked"]
VARIANTS = {
    "DDP": ["masking=none"],
    "N-SDP forward": ["masking=forward", "masking.coverage=0.5"],
    "N-SDP backward": ["masking=backward", "masking.coverage=0.5"],
    "B-SDP forward": ["masking=forward", "masking.granularity=block", "masking.coverage=0.5"],
    "B-SDP backward": ["masking=backward", "masking.granularity=block", "masking.coverage=0.5"],
    "FSDP + AC": ["masking=none", "parallelism=fsdp", "parallelism.activation_checkpointing=full"],
}
DEFAULT_VARIANTS = ["DDP", "N-SDP forward", "N-SDP backward", "B-SDP forward", "B-SDP backward"]
SMOKE = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=32"]
SMOKE_CONFIGS = [("DDP", False), ("DDP", True), ("N-SDP forward", False)]
MFU_TARGET = 0.40  # llama_1b DDP bf16 + compile (OLMo-core's 1B: 39-40% on H100)
# Each variant's compiled tokens/s against DDP's compiled (issue 59's goals).
SPEED_TARGETS = {"N-SDP forward": 1.5, "B-SDP forward": 1.7, "N-SDP backward": 0.9}


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
        if guard is not None:  # backward masking's refresh receives nothing under the fake group
            out["nonfinite_steps"] = len(guard.report())
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def configurations(variants: list[str], modes: list[bool], *, smoke: bool) -> list[tuple[str, bool]]:
    """(variant, compile) in the order they run: eager before compiled."""
    if smoke:
        return SMOKE_CONFIGS
    return [(v, c) for c in modes for v in variants]


def plan_micro(plan: dict, variant: str) -> int | None:
    """The plan's micro-batch for `variant` in bf16 without checkpointing (None: no such row fits)."""
    want = {"parallelism": "ddp", "activation_checkpointing": "none", "mixed_precision": "bf16", "sync_every": None}
    overrides = VARIANTS[variant]
    masking = next((o.split("=")[1] for o in overrides if o.startswith("masking=")), "none")
    granularity = "block" if "masking.granularity=block" in overrides else "neuron"
    for row in plan["rows"]:
        s = row["structure"]
        if not row.get("fits") or any(s.get(k) != v for k, v in want.items()) or s["masking"] != masking:
            continue
        if masking == "none" or (s["granularity"] == granularity and s["coverage"] == 0.5):
            return row["micro_batch"]
    return None


def config_lines(args) -> dict[str, list[str]]:
    """Each variant's command line: the plan's run at its micro-batch (DDP's where the plan has no
    row of the variant), bf16, the chunked loss; the tiny LLaMA for the rehearsal."""
    if args.smoke:
        return {v: [*SMOKE, *BASE, *VARIANTS[v], "trainer.global_batch_size=8"] for v in VARIANTS}
    plan = json.loads(args.plan.read_text())
    world, base = plan["run"]["world"], plan["run"]["overrides"]
    ddp = plan_micro(plan, "DDP") or 8
    return {
        v: [*base, *BASE, *VARIANTS[v], f"trainer.global_batch_size={(plan_micro(plan, v) or ddp) * world}"]
        for v in VARIANTS
    } | {"world": world}


def checks(rows: list[dict]) -> list[str]:
    """The targets' verdicts, from the rows measured."""
    got = {(r["variant"], r["compile"]): r for r in rows if "measured" in r}
    out = []
    ddp = got.get(("DDP", True))
    if ddp and ddp["measured"]["mfu"] is not None:
        mfu = ddp["measured"]["mfu"]
        out.append(
            f"- DDP + compile: MFU {mfu:.1%} ({'ok' if mfu >= MFU_TARGET else 'missed'}: target >= {MFU_TARGET:.0%})"
        )
    for variant, target in SPEED_TARGETS.items():
        row = got.get((variant, True))
        if row and ddp:
            ratio = row["measured"]["tokens_per_s"] / ddp["measured"]["tokens_per_s"]
            verdict = "ok" if ratio >= target else "missed"
            out.append(f"- {variant} compiled: {ratio:.2f} x DDP's tokens/s ({verdict}: target >= {target})")
    for (variant, compiled), r in got.items():
        m, est, step = r["measured"], r.get("estimated_peak"), r.get("modelled_step_s")
        how = "compiled" if compiled else "eager"
        if est and m["cuda_max_allocated"]:
            ratio, bound = m["cuda_max_allocated"] / est, 1.10 if compiled else 1.05
            verdict = "ok" if abs(ratio - 1) <= bound - 1 else "missed"
            out.append(f"- {variant} {how}: CUDA peak / estimate {ratio:.3f} ({verdict}: within {bound - 1:.0%})")
        if step:
            ratio = step / m["step_s"]
            verdict = "ok" if abs(ratio - 1) <= 0.15 else "missed"
            out.append(f"- {variant} {how}: modelled / measured step {ratio:.2f} ({verdict}: within 15%)")
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| variant | compile | micro-batch | tokens/s | MFU | step ms | modelled step ms | fwd / bwd / sync / optim ms "
        "| host syncs/step | CUDA peak GiB | estimated GiB | warm-up s |",
        "|" + "---|" * 12,
    ]
    for r in rows:
        head = f"| {r['variant']} | {'yes' if r['compile'] else 'no'} | {r['micro']} |"
        if "error" in r:
            lines.append(f"{head} error: {r['error']} |" + " |" * 8)
            continue
        m, est, step = r["measured"], r.get("estimated_peak"), r.get("modelled_step_s")
        ph = m["phases_s"]
        split = " / ".join(f"{1e3 * ph.get(k, 0):.0f}" for k in ("forward", "backward", "sync", "optimizer"))
        mfu = "" if m["mfu"] is None else f"{m['mfu']:.1%}"
        peak = "" if m["cuda_max_allocated"] is None else f"{m['cuda_max_allocated'] / GIB:.2f}"
        lines.append(
            f"{head} {m['tokens_per_s']:.0f} | {mfu} | {1e3 * m['step_s']:.0f} | {_ms(step)} "
            f"| {split} | {m['host_syncs_per_step']:.1f} | {peak} | {'' if est is None else f'{est / GIB:.2f}'} "
            f"| {m['warmup_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{1e3 * seconds:.0f}"


def estimates(lines: dict, variants: list[str], *, world: int, cluster: str) -> dict:
    """Each variant's estimated peak and modelled step, eager and compiled (one trace a variant)."""
    out = {}
    for variant in variants:
        cfg = load_config(lines[variant], world_size=world, offline=True, check_data=False)
        est = estimate(cfg, world_size=world, rank=busiest_rank(cfg, world_size=world))
        for compiled in (False, True):
            step = step_times(dataclasses.replace(est, compiled=compiled), load_cluster(cluster))
            out[variant, compiled] = {
                "estimated_peak": est.memory["peak_bytes"],
                "modelled_step_s": step["step_overlapped_s"],
            }
    return out


def child(spec: dict) -> dict:
    """One configuration, measured in this process (`--child`)."""
    cfg = load_config(spec["line"], world_size=spec["world"], offline=True, check_data=False)
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, on_nonfinite="stop"))
    rank = busiest_rank(cfg, world_size=spec["world"])
    return measure(cfg, world_size=spec["world"], rank=rank, device=torch.device(spec["device"]), steps=spec["steps"])


def run_child(spec: dict, *, timeout: float) -> dict:
    """`child(spec)` in a process of its own: what it measured, or its error in one line."""
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"over the budget ({timeout:.0f} s left)"}
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if proc.returncode or not last.startswith("{"):
        tail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        return {"error": tail[:300]}
    return json.loads(last)


def run(args) -> list[dict]:
    device = torch.device("cpu" if args.smoke else args.device)
    name = torch.cuda.get_device_name(device).split()[-1].lower() if device.type == "cuda" else "cpu"
    cluster = "h200_nvlink" if "h200" in name else "h100_nvlink"
    out_md, out_json = args.out / f"gpu_speed_{name}.md", args.out / f"gpu_speed_{name}.json"
    lines = config_lines(args)
    world = 2 if args.smoke else lines.pop("world")
    chosen = configurations(args.variants, [m == "yes" for m in args.compile], smoke=args.smoke)
    start = time.perf_counter()
    est = estimates(lines, sorted({v for v, _ in chosen}), world=world, cluster=cluster)
    rows = []
    for variant, compiled in chosen:
        left = 60 * args.budget_min - (time.perf_counter() - start)
        if left <= 0:
            print(f"budget of {args.budget_min} min spent: {variant} and later not run", flush=True)
            break
        line = [*lines[variant], f"parallelism.compile={str(compiled).lower()}"]
        row = {"variant": variant, "compile": compiled, "micro": int(line[-2].split("=")[1]) // world}
        spec = {"line": line, "world": world, "device": str(device), "steps": args.steps}
        result = run_child(spec, timeout=left)
        row |= {"measured": result} if "error" not in result else result
        row |= est[variant, compiled]
        rows.append(row)
        print(json.dumps(row)[:400], flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        out_json.write_text(
            json.dumps({"device": name, "torch": torch.__version__, "cluster": cluster, "rows": rows}, indent=1)
        )
        head = f"# Speed of one rank on {name} ({torch.__version__}, world size {world}, modelled on {cluster})\n\n"
        out_md.write_text(head + table(rows) + "\n" + "\n".join(checks(rows)) + "\n")
    print(out_md.read_text() if rows else "nothing measured")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", type=Path, default=Path("results/plan/nvlink/plan.json"))
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    parser.add_argument("--compile", nargs="+", default=["no", "yes"], choices=["no", "yes"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--budget-min", type=float, default=7.5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("results/bench"))
    parser.add_argument("--smoke", action="store_true", help="rehearse on the CPU: the tiny LLaMA, 2 steps")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one configuration, as JSON (run_child)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.smoke:
        args.steps = 2
    rows = run(args)
    return 0 if rows and all("measured" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
