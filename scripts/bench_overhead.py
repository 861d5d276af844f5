"""What a step pays per op: kernel launches and host time per phase of one rank of a K-worker job.

    python scripts/bench_overhead.py [--models llama_134m resnet18] [--world-size 8]
                                     [--variants ...] [--steps 3] [--out results/bench] [--smoke]

On a GPU every op of a step is a kernel launch, a few microseconds whatever its size, so a step
of thousands of small ops is bound by them. This counts them anywhere, with no GPU: this process
plays the busiest rank of the job under a fake process group (collectives move nothing), builds
the run's own strategy and the optimizer a CUDA run builds (fused AdamW where every trained
tensor is dense, else torch's foreach, as `sdp.optim.build_optimizer` chooses on CUDA, with the
NaN/Inf check the trainer pairs with it), and runs the trainer's own `train_step` on the CPU.
After two warm-up steps, one step is counted by `sdp.metrics.launches.LaunchCounter` per phase of
the trainer's timer (data, forward, backward, sync, optimizer; under `outer=diloco` the outer
sync, which runs outside `train_step`, counted once), then `--steps` steps are timed per phase.

The host time is the CPU's wall time of each phase at a micro-batch of 1 and short sequences:
there the ops are small, so a phase of many ops shows it, but it includes the CPU's compute (the
optimizer's over every trained element above all): read the launches as what a GPU pays, the
times as the same order on this machine.

Results go to OUT/overhead_cpu.md and .json. `--smoke` rehearses it on the tiny models with four
variants (the test suite runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from sdp import dist
from sdp.metrics.comm import CommCounter
from sdp.metrics.launches import LaunchCounter, is_dense
from sdp.optim import build_optimizer
from sdp.planning.estimator import dummy_batch, outer_loop
from sdp.planning.ranks import busiest_rank
from sdp.run.build import build_strategy
from sdp.run.config import load_config
from sdp.run.measure import PhaseTimer
from sdp.run.nonfinite import NonFiniteGuard, skips_on_device
from sdp.run.trainer import train_step
from sdp.run.trainer_config import micro_batch_size

PHASES = ("forward", "backward", "sync", "optimizer")
MODELS = {
    "llama_134m": ["model=llama_134m", "dataset=synthetic_text", "dataset.seq_len=32", "optim=adamw"],
    "resnet18": ["model=resnet18", "dataset=synthetic_image", "optim=adamw"],
    "llama_tiny": ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=16", "optim=adamw"],
    "resnet_tiny": ["model=resnet_tiny", "dataset=synthetic_image", "dataset.image_size=16", "optim=adamw"],
}
COMMON = ["trainer.grad_clip=1.0", "parallelism.mixed_precision=fp32", "trainer.on_nonfinite=stop"]
FSDP = ["parallelism=fsdp", "parallelism.fsdp_degree=2"]
OUTER = ["outer=diloco", "outer.sync_every=10"]


def _variants() -> dict[str, list[str]]:
    out = {"DDP": ["masking=none"]}
    for gran, mode, c in itertools.product(("neuron", "block"), ("backward", "forward"), (0.5, 0.25)):
        name = f"{'N' if gran == 'neuron' else 'B'}-SDP {mode} C={c:g}"
        out[name] = [f"masking={mode}", f"masking.granularity={gran}", f"masking.coverage={c}"]
    # r random holders a chunk: more holder sets (forward masking refuses it on llama_134m: a
    # worker would hold none of a layer's 12 heads)
    out["N-SDP backward C=0.5 random"] = [
        *out["N-SDP backward C=0.5"],
        "masking.construction=random",
        "parallelism.max_comm_groups=64",
    ]
    out["FSDP"] = ["masking=none", "parallelism=fsdp"]
    out["N-SDP forward C=0.5 x FSDP 2"] = [*out["N-SDP forward C=0.5"], *FSDP]
    out["B-SDP forward C=0.5 x FSDP 2"] = [*out["B-SDP forward C=0.5"], *FSDP]
    for name in ("DDP", "N-SDP backward C=0.5", "N-SDP forward C=0.5", "B-SDP backward C=0.5", "B-SDP forward C=0.5"):
        out[f"{name} + DiLoCo"] = [*out[name], *OUTER]
    return out


VARIANTS = _variants()
SMOKE_VARIANTS = ["DDP", "N-SDP backward C=0.5", "DDP + DiLoCo", "N-SDP forward C=0.5 + DiLoCo"]


class CountingTimer(PhaseTimer):
    """The trainer's timer, which also sends the launches of each phase to `counter`."""

    def __init__(self, device: torch.device, counter: LaunchCounter):
        super().__init__(device)
        self.counter = counter

    @contextlib.contextmanager
    def __call__(self, phase: str):
        with self.counter.counting(phase), super().__call__(phase):
            yield


class FiniteFakeGroup(LaunchCounter):
    """The launch counter, which also gives what a fake collective receives a value: a fake
    broadcast or all-gather leaves its buffer as allocated, and garbage there would make the
    weights non-finite and the NaN/Inf check stop the step. Received values are zeros (the
    counts do not depend on them). Its own writes are not counted."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        name = func.name()
        if name == "c10d::broadcast_" and args[2] != torch.distributed.get_rank():
            torch._foreach_zero_(list(args[0]))
        elif name == "c10d::allgather_":
            torch._foreach_zero_([o for outputs in args[0] for o in outputs])
        elif name == "c10d::_allgather_base_":
            args[0].zero_()
        return out


def _structure(strategy) -> dict:
    """Buckets and pieces of the rank's gradient sync (SDP's), and its trained tensors."""
    trained = strategy.trainable()
    out = {"trained_tensors": len(trained), "dense": all(is_dense(getattr(p, "_local_tensor", p)) for p in trained)}
    grads = getattr(strategy, "sync", None)
    if grads is not None:
        out["buckets"] = len(grads.buckets)
        out["pieces"] = len(grads.entries)
    refresh = getattr(getattr(strategy, "step_sync", None), "refresh", None)
    if refresh is not None and refresh.overlapped is not None:
        out["refresh_buckets"] = len(refresh.overlapped.buckets)
        out["refresh_pieces"] = len(refresh.transfers)
    return out


class Rank:
    """One rank of the job, built as a CUDA run builds it, inside the fake process group open."""

    def __init__(self, cfg, *, world_size: int, rank: int):
        self.cfg, self.device = cfg, torch.device("cpu")
        self.micro = micro_batch_size(cfg.trainer, world_size=world_size)
        world = dist.World(rank=rank, local_rank=0, world_size=world_size)
        comm = CommCounter()
        self.strategy = build_strategy(cfg, world=world, device=self.device, comm=comm)
        cuda = torch.device("cuda")  # the optimizer a CUDA run builds (its tensors stay on the CPU)
        self.optimizer = build_optimizer(self.strategy.trainable(), cfg.optim, device=cuda, default_foreach=True)
        fused = skips_on_device(self.optimizer)
        self.guard = NonFiniteGuard("stop", max_skips=0, device=self.device) if fused else None
        self.outer = outer_loop(cfg, self.strategy, comm=comm, device=self.device)
        self.batches = itertools.repeat(dummy_batch(cfg, self.micro))
        self.strategy.model.train()

    def step(self, timer: PhaseTimer) -> None:
        s = self
        train_step(
            s.strategy,
            s.optimizer,
            s.batches,
            cfg=s.cfg.trainer,
            micro=s.micro,
            device=s.device,
            timer=timer,
            guard=s.guard,
        )

    def count(self, counter: LaunchCounter) -> dict:
        """One step's launches per phase, and an outer sync's (a window's syncs are one each)."""
        counter.counts.clear(), counter.by_op.clear(), counter.host_reads.clear()
        self.step(CountingTimer(self.device, counter))
        if self.outer is not None:
            with counter.counting("outer sync"):
                self.outer.sync(0)
        counted = dict(counter.counts)
        return {
            "launches": {p: counted.get(p, 0) for p in (*PHASES, "outer sync") if p in counted or p in PHASES},
            # A non-fused optimizer's step counts live on the host in a CUDA run too: not the device's.
            "host_reads": {p: n for p, n in counter.host_reads.items() if p != "optimizer"},
            "top_ops": {phase: counter.top(phase) for phase in counted},
        }

    def time(self, steps: int) -> dict:
        """Wall time per phase over `steps` steps, and of an outer sync."""
        timer, start = PhaseTimer(self.device), time.perf_counter()
        for _ in range(steps):
            self.step(timer)
        out = {"step_s": (time.perf_counter() - start) / steps}
        out["host_s"] = {p: v / steps for p, v in timer.read().items() if p in PHASES}
        if self.outer is not None:
            start = time.perf_counter()
            self.outer.sync(0)
            out["host_s"]["outer sync"] = time.perf_counter() - start
        return out

    def structure(self) -> dict:
        out = _structure(self.strategy)
        if self.outer is not None:
            out["outer_buckets"] = len(self.outer.buckets[0])
        fused, foreach = self.guard is not None, self.optimizer.defaults.get("foreach")
        out["optimizer"] = "fused" if fused else "foreach" if foreach else "per-tensor loop"
        return out


def measure(cfg, *, world_size: int, rank: int, steps: int) -> dict:
    """Launches (one counted step, after two warm-up ones) and host time (`steps` timed ones)
    per phase of `rank`."""
    counter = FiniteFakeGroup("build")
    with dist.fake_process_group(rank, world_size), counter:
        me = Rank(cfg, world_size=world_size, rank=rank)
        for _ in range(2):
            me.step(PhaseTimer(me.device))
        counted = me.count(counter)
        counter.phase = "timed"
        out = {**me.time(steps), **counted, **me.structure()}
        if me.guard is not None:
            me.guard.report()
    gc.collect()
    return out


def config(model: str, variant: str, *, world_size: int):
    micro = 1 if model.startswith("llama") else 2  # BatchNorm needs two values a channel
    overrides = [*MODELS[model], *COMMON, f"trainer.global_batch_size={micro * world_size}", *VARIANTS[variant]]
    return load_config(overrides, world_size=world_size, offline=True, check_data=False)


def baseline_of(variant: str) -> str:
    """The row a variant is compared with: DDP, FSDP, or DDP + DiLoCo for its like."""
    if variant.endswith("+ DiLoCo"):
        return "DDP + DiLoCo"
    return "FSDP" if "FSDP" in variant else "DDP"


def compute_launches(row: dict) -> int:
    return sum(row["launches"][p] for p in ("forward", "backward", "sync"))


def verdicts(rows: list[dict]) -> list[dict]:
    """Each SDP row against the targets: its sync phase (an outer sync apart) at most 4 launches
    a bucket + 20, and forward + backward + sync at most 1.25 x DDP's; with the ratio to its like
    (FSDP, DDP + DiLoCo) beside it."""
    by = {(r["model"], r["variant"]): r for r in rows}
    out = []
    for r in rows:
        if "buckets" not in r:
            continue
        ddp, like = by.get((r["model"], "DDP")), by.get((r["model"], baseline_of(r["variant"])))
        ratio = compute_launches(r) / compute_launches(ddp) if ddp else None
        sync_budget = 4 * (r["buckets"] + r.get("refresh_buckets", 0)) + 20  # backward masking's refresh too
        v = {
            "model": r["model"],
            "variant": r["variant"],
            "sync": r["launches"]["sync"],
            "sync_budget": sync_budget,
            "sync_ok": r["launches"]["sync"] <= sync_budget,
            "vs_ddp": ratio,
            "vs_like": compute_launches(r) / compute_launches(like) if like else None,
            "ratio_ok": ratio is not None and ratio <= 1.25,
            "dense": r["dense"],
        }
        if "outer sync" in r["launches"]:
            v["outer_sync"] = r["launches"]["outer sync"]
            v["outer_budget"] = 4 * r["outer_buckets"] + 20
            v["outer_ok"] = v["outer_sync"] <= v["outer_budget"]
        out.append(v)
    return out


def _buckets(row: dict) -> str:
    if "buckets" not in row:
        return ""
    return f"{row['buckets']}" + (f" ({row['refresh_buckets']})" if row.get("refresh_buckets") else "")


def _ms(row: dict, phase: str) -> str:
    s = row["host_s"].get(phase)
    return "" if s is None else f"{1e3 * s:.0f}"


def table(rows: list[dict], before: dict | None = None) -> str:
    """One line a row: its structure, launches and host time per phase, the ratio to its baseline."""
    by = {(r["model"], r["variant"]): r for r in rows}
    head = (
        "| model | variant | optimizer | buckets (refresh) | pieces | forward | backward | sync | optimizer "
        "| outer sync | fwd+bwd+sync vs baseline | host ms fwd / bwd / sync / optim / outer | trained tensors dense |"
    )
    if before:
        head += " before: fwd+bwd+sync, optimizer launches |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        base = by.get((r["model"], baseline_of(r["variant"])))
        ratio = f"{compute_launches(r) / compute_launches(base):.2f}" if base else ""
        la = r["launches"]
        times = " / ".join(_ms(r, p) for p in (*PHASES, "outer sync")).rstrip(" /")
        line = (
            f"| {r['model']} | {r['variant']} | {r['optimizer']} | {_buckets(r)} | {r.get('pieces', '')} "
            f"| {la['forward']} | {la['backward']} | {la['sync']} | {la['optimizer']} | {la.get('outer sync', '')} "
            f"| {ratio} | {times} | {'yes' if r['dense'] else '**no**'} |"
        )
        if before:
            b = before.get((r["model"], r["variant"]))
            line += f" {compute_launches(b)}, {b['launches']['optimizer']} |" if b else " |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def check_lines(rows: list[dict]) -> list[str]:
    out = []
    for v in verdicts(rows):
        ratio = "" if v["vs_ddp"] is None else f"{v['vs_ddp']:.2f}"
        line = (
            f"- {v['model']} {v['variant']}: sync {v['sync']} launches, budget {v['sync_budget']} "
            f"({'ok' if v['sync_ok'] else 'missed'}); fwd+bwd+sync {ratio} x DDP's "
            f"({'ok' if v['ratio_ok'] else 'missed'}: target <= 1.25)"
        )
        if baseline_of(v["variant"]) != "DDP" and v["vs_like"] is not None:
            line += f", {v['vs_like']:.2f} x {baseline_of(v['variant'])}'s"
        if "outer_sync" in v:  # no target of its own: what the bucket budget would be
            line += f"; outer sync {v['outer_sync']} launches (4 a bucket + 20 would be {v['outer_budget']})"
        out.append(line + ("" if v["dense"] else "; trains non-dense tensors"))
    return out


HEADER = """# Kernel launches and host time per phase of one rank's step (CPU, fake process group)

`{command}` at commit {commit}, on {machine}, torch {torch}, K = {world}, the busiest rank, micro-batch 1 (LLaMA,
32 tokens) or 2 (ResNet, 32 x 32), fp32, gradient clipping at 1.0, the NaN/Inf check the
trainer pairs with the optimizer a CUDA run builds. *Launches* are kernel-like ops counted by
`sdp.metrics.launches` in one steady step (views and allocations free; a `_foreach_` op one
launch when all its tensors are dense, else one a tensor); the *outer sync* (`outer=diloco`,
H = 10) runs outside `train_step` and is counted once, for a whole sync. *Host ms*: this CPU's
wall time per phase, mean of {steps} steps, compute included. *Baseline*: DDP, FSDP (for SDP x
FSDP, F = 2) or DDP + DiLoCo (the targets are judged against DDP's, the ratio to the others is
given beside). *Buckets*: the gradient averaging's, and in brackets backward
masking's weight refresh's. Targets (issue 59): sync <= 4 launches a bucket (both kinds) + 20,
and forward + backward + sync <= 1.25 x the baseline's.

"""


def commit() -> str:
    """The checkout's commit, marked `+changes` when its tracked files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "src", "scripts"], check=False).returncode
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + (" +changes" if dirty else "")


def report(rows: list[dict], args, before: dict | None) -> str:
    text = HEADER.format(
        command="python scripts/bench_overhead.py " + " ".join(args.argv),
        commit=args.commit,
        machine=f"{os.cpu_count()} CPU cores",
        torch=torch.__version__,
        world=args.world_size,
        steps=args.steps,
    )
    return text + table(rows, before) + "\n" + "\n".join(check_lines(rows)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama_134m", "resnet18"], choices=list(MODELS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results/bench"))
    parser.add_argument("--name", default="overhead_cpu", help="the files' name: OUT/NAME.md and .json")
    parser.add_argument("--before", type=Path, help="an earlier run's .json: its launches beside these")
    parser.add_argument("--smoke", action="store_true", help="rehearse: the tiny models, four variants, one step")
    args = parser.parse_args(argv)
    args.argv, args.commit = (sys.argv[1:] if argv is None else argv), commit()
    if args.smoke:
        args.models, args.variants, args.steps = ["llama_tiny", "resnet_tiny"], SMOKE_VARIANTS, 1
    before = None
    if args.before:
        before = {(r["model"], r["variant"]): r for r in json.loads(args.before.read_text())["rows"]}
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    for model, variant in itertools.product(args.models, args.variants):
        cfg = config(model, variant, world_size=args.world_size)
        rank = busiest_rank(cfg, world_size=args.world_size)
        row = {"model": model, "variant": variant, "rank": rank}
        row.update(measure(cfg, world_size=args.world_size, rank=rank, steps=args.steps))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "top_ops"}), flush=True)
        meta = {"torch": torch.__version__, "world_size": args.world_size, "command": args.argv, "commit": args.commit}
        (args.out / f"{args.name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
        (args.out / f"{args.name}.md").write_text(report(rows, args, before))
    print((args.out / f"{args.name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
