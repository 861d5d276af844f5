"""Measure this machine as a `conf/cluster/*.yaml` describes one: what the step-time model needs.

    python -m torch.distributed.run --standalone --nproc_per_node=4 scripts/calibrate_cpu_cluster.py [--out FILE]

Every process measures at once, as the processes of a run share the cores:

- peak FLOP/s: fp32 matrix products of 512 x 512 by 512 x 512;
- memory bandwidth: copies of 64 MiB tensors (read and write counted);
- the links: gloo all-reduces of 64 KiB to 8 MiB over all processes and over pairs, fitted to
  the ring model t = 2(n - 1) alpha + 2(n - 1)/n B / beta by least squares, and broadcasts
  over all processes for their own per-hop latency (gloo's is a few times cheaper);
- the compute efficiency: one forward and backward of each bench model (the tiny LLaMA with a
  256-token vocabulary and the tiny ResNet, 16 samples), its counted FLOPs over its time, against
  the peak; the file takes their mean;
- how much communication slows the compute beside it: matrix products timed alone and with a
  queue of 1 MiB all-reduces in flight (gloo's threads share the cores).

Rank 0 prints the YAML (and writes it with --out).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sdp.metrics.flops import flop_counter
from sdp.models import build_model
from sdp.run.config import typed_config

SIZES = [2**16, 2**18, 2**20, 2**21, 2**22, 2**23]  # bytes


def _timed(fn, *, seconds: float = 1.5, min_reps: int = 3) -> float:
    """Mean seconds of fn() over repetitions lasting about `seconds` (after one warm-up)."""
    fn()
    reps, start = 0, time.perf_counter()
    while reps < min_reps or time.perf_counter() - start < seconds:
        fn()
        reps += 1
    return (time.perf_counter() - start) / reps


def peak_flops() -> float:
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    return 2 * 512**3 / _timed(lambda: a @ b)


def memory_gbps() -> float:
    src, dst = torch.randn(16 * 2**20), torch.empty(16 * 2**20)
    return 2 * src.numel() * 4 / _timed(lambda: dst.copy_(src)) / 1e9


def collective_times(group, n: int, *, broadcast: bool = False) -> list[tuple[int, int, float]]:
    """(ranks, bytes, median seconds) of all-reduces (or broadcasts from rank 0) of each size over `group`."""
    out = []
    for size in SIZES:
        t = torch.zeros(size // 4)
        dist.barrier()
        times = []
        for _ in range(7):
            start = time.perf_counter()
            if broadcast:
                dist.broadcast(t, src=0, group=group)
            else:
                dist.all_reduce(t, group=group)
            times.append(time.perf_counter() - start)
        out.append((n, size, statistics.median(times)))
    return out


def fit_broadcast(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(hop s, bytes/s) of t = (n - 1) hop + B / beta over broadcasts of one group size, least squares."""
    n = points[0][0]
    slope, intercept = statistics.linear_regression([size for _, size, _ in points], [t for *_, t in points])
    return max(intercept, 0.0) / (n - 1), 1 / slope


def fit_links(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(alpha s, beta bytes/s) of t = 2(n-1) alpha + 2(n-1)/n B / beta, least squares."""
    xs = [(2 * (n - 1), 2 * (n - 1) / n * size) for n, size, _ in points]
    ys = [t for _, _, t in points]
    # Normal equations of y = a x0 + c x1 (c = 1 / beta).
    s00 = sum(x0 * x0 for x0, _ in xs)
    s01 = sum(x0 * x1 for x0, x1 in xs)
    s11 = sum(x1 * x1 for _, x1 in xs)
    b0 = sum(x0 * y for (x0, _), y in zip(xs, ys, strict=True))
    b1 = sum(x1 * y for (_, x1), y in zip(xs, ys, strict=True))
    det = s00 * s11 - s01 * s01
    alpha, inv_beta = (b0 * s11 - b1 * s01) / det, (s00 * b1 - s01 * b0) / det
    return max(alpha, 0.0), 1 / inv_beta


def efficiency(overrides: list[str], batch: dict, peak: float) -> float:
    """Counted FLOPs of one forward and backward over their time, against `peak`."""
    torch.manual_seed(0)
    model = build_model(typed_config(overrides).model)

    def step():
        model.zero_grad(set_to_none=True)
        out = model(batch["inputs"])
        logits = out.logits if hasattr(out, "logits") else out
        F.cross_entropy(logits.flatten(0, -2), batch["targets"].flatten()).backward()

    with flop_counter() as counter:
        step()
    return counter.get_total_flops() / _timed(step) / peak


def compute_share(k: int) -> float:
    """The compute's slowdown per second of gloo all-reduces running beside it: the same
    matrix products timed alone and with a queue of 1 MiB all-reduces in flight, over the
    time the all-reduces ran beside them."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    products = 40

    def compute() -> float:
        start = time.perf_counter()
        for _ in range(products):
            a @ b
        return time.perf_counter() - start

    compute()
    dist.barrier()
    alone = statistics.median(compute() for _ in range(5))
    tensors, comm, slowed = [torch.zeros(2**18) for _ in range(24)], [], []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        works = [dist.all_reduce(t, async_op=True) for t in tensors]  # queued: they run one after another
        slowed.append(compute())
        for work in works:
            work.wait()
        comm.append(time.perf_counter() - start)
    beside = min(statistics.median(comm), statistics.median(slowed))  # the part that ran beside the compute
    return max(0.0, (statistics.median(slowed) - alone) / beside)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, k = dist.get_rank(), dist.get_world_size()
    peak, mem = peak_flops(), memory_gbps()
    tokens = torch.randint(0, 256, (16, 33))
    llama = efficiency(
        ["model=llama_tiny", "dataset=synthetic_text", "model.vocab_size=256"],
        {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]},
        peak,
    )
    images = {"inputs": torch.randn(16, 3, 32, 32), "targets": torch.randint(0, 10, (16,))}
    resnet = efficiency(["model=resnet_tiny", "dataset=synthetic_image"], images, peak)
    pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(k // 2)]
    points = collective_times(None, k) + collective_times(pairs[rank // 2], 2)
    alpha, beta = fit_links(points)
    hop, beta_b = fit_broadcast(collective_times(None, k, broadcast=True))
    share = compute_share(k)
    per_rank = [None] * k
    dist.all_gather_object(per_rank, (peak, mem, llama, resnet, share))
    if rank == 0:
        peak = statistics.mean(p for p, *_ in per_rank)
        mem = statistics.mean(m for _, m, *_ in per_rank)
        eff = statistics.mean(e for _, _, lla, res, _ in per_rank for e in (lla, res))
        share = statistics.mean(r[4] for r in per_rank)
        lines = [
            f"# This machine, {k} gloo processes on {torch.get_num_threads()} thread(s) each, measured by",
            f"# scripts/calibrate_cpu_cluster.py on {time.strftime('%Y-%m-%d')} (every process at once).",
            "name: cpu_2core",
            f"description: {k} CPU processes sharing this machine's cores, gloo over loopback",
            f"devices_per_node: {k}",
            f"peak_tflops_bf16: {peak / 1e12:.4f}   # not measured: bf16 is not used on CPU",
            f"peak_tflops_fp32: {peak / 1e12:.4f}   # 512^3 fp32 matmuls, per process",
            f"efficiency: {eff:.3f}           # counted FLOPs / time of the bench models' forward+backward "
            f"(LLaMA {statistics.mean(r[2] for r in per_rank):.3f}, "
            f"ResNet {statistics.mean(r[3] for r in per_rank):.3f})",
            f"memory_gbps: {mem:.2f}          # 64 MiB copies, per process",
            f"intra_node_gbps: {beta / 1e9:.3f}      # fitted gloo all-reduce bandwidth (ring model)",
            f"intra_node_latency_us: {alpha * 1e6:.1f}  # fitted per ring step",
            f"inter_node_gbps: {beta / 1e9:.3f}      # one machine: as within",
            f"inter_node_latency_us: {alpha * 1e6:.1f}",
            f"broadcast_latency_us: {hop * 1e6:.1f}   # fitted per hop of gloo's broadcasts",
            f"broadcast_gbps: {beta_b / 1e9:.3f}        # fitted bandwidth of gloo's broadcasts",
            f"comm_compute_share: {share:.2f}       # matmuls' slowdown per second of an all-reduce beside them",
        ]
        text = "\n".join(lines) + "\n"
        print(text)
        if args.out:
            args.out.write_text(text)
        for n, size, t in points:
            model = 2 * (n - 1) * alpha + 2 * (n - 1) / n * size / beta
            print(
                f"# all-reduce n={n} {size / 2**20:6.3f} MiB: {t * 1e3:7.2f} ms measured, {model * 1e3:7.2f} ms fitted"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
