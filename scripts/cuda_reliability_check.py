"""What the reliability checks cost on a GPU: the per-step NaN/Inf check and checksummed checkpoints.

    python scripts/cuda_reliability_check.py [--model M] [--steps N] [--seq-len L] [--repeats R] [--out DIR]

Runs the entrypoint (torchrun, one process on one GPU, bf16) on synthetic text,
after one discarded warm-up launch, alternating trainer.on_nonfinite=stop and
off, `--repeats` times each, with a
checkpoint every `--steps`/3 steps; reports tokens/s of both (the check's cost
is one host sync and one 2-element all-reduce per step), the checkpoints' wall time
and size (written, SHA-256 checksummed and fsynced), and SHA-256 throughput.
Writes DIR/cuda_reliability_check.json and .md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from sdp.launching.variants import torchrun_command
from sdp.rundir import CHECKPOINTS, read_summary


def run(model: str, steps: int, seq_len: int, on_nonfinite: str, run_dir: Path) -> dict:
    overrides = [
        f"model={model}",
        "dataset=synthetic_text",
        f"dataset.seq_len={seq_len}",
        "trainer.global_batch_size=8",
        f"trainer.max_steps={steps}",
        f"trainer.checkpoint_every={steps // 3}",
        "trainer.eval_every=0",
        "trainer.log_every=10",
        "trainer.save_model=false",
        "trainer.export=none",
        "trainer.progress=false",
        "dataset.eval_batches=1",
        "parallelism.mixed_precision=bf16",
        "logger=none",
        f"trainer.on_nonfinite={on_nonfinite}",
        f"run_dir={run_dir}",
    ]
    proc = subprocess.run(torchrun_command(1, "-m", "sdp.train", *overrides), capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    summary = read_summary(run_dir)
    size = sum(p.stat().st_size for p in (run_dir / CHECKPOINTS).rglob("*") if p.is_file())
    kept = len(list((run_dir / CHECKPOINTS).iterdir()))
    return {
        "on_nonfinite": on_nonfinite,
        "tokens_per_s": summary.tokens_or_samples_per_s,
        "step_time_s": summary.step_time_s,
        "checkpoints_written": summary.checkpoints_written,
        "checkpoint_time_s": summary.checkpoint_time_s,
        "checkpoint_gib": size / kept / 2**30,
    }


def sha256_throughput(path: Path) -> float:
    """GB/s of hashing one checkpoint file (from the page cache: what a resume check costs at most)."""
    start = time.perf_counter()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(1 << 24):
            h.update(piece)
    return path.stat().st_size / (time.perf_counter() - start) / 1e9


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama_134m")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "outputs/cuda_reliability")))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    run(args.model, args.steps, args.seq_len, "off", args.out / "runs" / "warmup")  # first-launch costs, discarded
    runs = []
    for i in range(args.repeats):
        for mode in ("stop", "off"):
            runs.append(run(args.model, args.steps, args.seq_len, mode, args.out / "runs" / f"{mode}-{i}"))
            print(json.dumps(runs[-1]), flush=True)
    files = sorted((args.out / "runs").glob("stop-0/checkpoints/*/rank*.pt"))
    result = {"model": args.model, "runs": runs, "sha256_gb_per_s": sha256_throughput(files[-1]) if files else None}

    def mean(mode, key):
        values = [r[key] for r in runs if r["on_nonfinite"] == mode]
        return sum(values) / len(values)

    result["check_cost"] = 1 - mean("stop", "tokens_per_s") / mean("off", "tokens_per_s")
    result["checkpoint_s_each"] = sum(r["checkpoint_time_s"] for r in runs) / sum(
        r["checkpoints_written"] for r in runs
    )
    (args.out / "cuda_reliability_check.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Reliability costs on one GPU: {args.model}, bf16, 8 x {args.seq_len} tokens per step",
        "",
        f"- tokens/s with the NaN/Inf check: {mean('stop', 'tokens_per_s'):.0f}; "
        f"without: {mean('off', 'tokens_per_s'):.0f} (cost {100 * result['check_cost']:.2f}%)",
        f"- one checkpoint ({runs[0]['checkpoint_gib']:.2f} GiB: model, AdamW state, RNG; written, "
        f"SHA-256 checksummed, fsynced): {result['checkpoint_s_each']:.2f} s",
        f"- SHA-256 over a checkpoint file: {result['sha256_gb_per_s']:.2f} GB/s",
    ]
    (args.out / "cuda_reliability_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
