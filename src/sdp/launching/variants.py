"""Run several variants of one configuration with torchrun and compare them with the first.

Used by `scripts/demo.py` (make run) and `scripts/bench_sdp.py`: each variant is
one `python -m sdp.train --nproc-per-node=N` launch whose run dir keeps config.yaml,
metrics.jsonl and summary.json; the table is built from the summaries.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sdp.rundir import Summary, read_summary


@dataclass
class Result:
    label: str
    run_dir: Path
    wall_s: float
    summary: Summary | None  # None when the run failed

    @property
    def static_bytes(self) -> int:
        return self.summary.static_bytes


def torchrun_command(nproc: int, *target: str) -> list[str]:
    """`torchrun --standalone --nproc_per_node=nproc TARGET...` with this interpreter."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *target]


def train_command(nproc: int, *args: str) -> list[str]:
    """`python -m sdp.train --nproc-per-node=nproc ARGS...` with this interpreter: the entrypoint
    as its own launcher (`sdp.launching.torchrun`)."""
    return [sys.executable, "-m", "sdp.train", f"--nproc-per-node={nproc}", *args]


def launch(overrides: list[str], *, run_dir: Path, nproc: int) -> tuple[int, float]:
    """One `python -m sdp.train --nproc-per-node=nproc` run; returns (exit code, wall seconds).
    Ctrl-C reaches the run as well, which stops with a checkpoint and says so: this waits for it
    (exit code 130) rather than killing it."""
    cmd = train_command(nproc, *overrides, f"run_dir={run_dir}")
    print("$ python", " ".join(cmd[1:]), flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    while True:
        try:
            return proc.wait(), time.perf_counter() - start
        except KeyboardInterrupt:
            continue


def run_variants(base: list[str], variants: list[tuple[str, list[str]]], *, root: Path, nproc: int) -> list[Result]:
    """Launch `base + overrides` for every (label, overrides); failures are recorded, not raised."""
    results = []
    for i, (label, overrides) in enumerate(variants):
        run_dir = root / f"{i}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', label)}"  # '=' would break the override
        rc, wall = launch(base + overrides, run_dir=run_dir, nproc=nproc)
        summary = read_summary(run_dir)
        if rc != 0 or summary is None or summary.status != "completed":
            summary = None
        results.append(Result(label, run_dir, wall, summary))
        if rc == 130:  # Ctrl-C: the run said where it stopped; the variants after it are not started
            print(f"interrupted: {len(variants) - i - 1} variants after {label!r} not run", flush=True)
            break
    return results


def _quality(s: Summary) -> str:
    return f"{s.eval_acc:.2%} acc" if s.eval_acc is not None else f"{s.eval_loss:.3f} loss"


def _ratio(a: float | None, b: float | None) -> str:
    return "" if not a or not b else f"{a / b:.2f}"


def _peak(s: Summary | None) -> int | None:
    return s and s.memory.get("peak_bytes")


def comparison_table(results: list[Result]) -> str:
    """Markdown table: quality, per-rank bytes, comm and step time, with ratios to the first row."""
    head = (
        "| variant | eval | train loss | params+grads+optim GiB/rank | vs DDP | live peak GiB/rank | vs DDP "
        "| comm MiB/step | vs DDP | step s | vs DDP | wall s |"
    )
    lines = [head, "|" + "---|" * 12]
    base = results[0] if results[0].summary else None
    for r in results:
        s = r.summary
        if s is None:
            lines.append(f"| {r.label} | failed |" + " |" * 9 + f" {r.wall_s:.0f} |")
            continue
        mem, comm, step, peak = r.static_bytes, s.comm_bytes_per_step, s.step_time_s, _peak(s)
        peak_gib = "" if peak is None else f"{peak / 2**30:.4f}"
        lines.append(
            f"| {r.label} | {_quality(s)} | {s.train_loss:.3f} | {mem / 2**30:.4f} | "
            f"{_ratio(mem, base and base.static_bytes)} | {peak_gib} | {_ratio(peak, _peak(base and base.summary))} | "
            f"{comm / 2**20:.2f} | "
            f"{_ratio(comm, base and base.summary.comm_bytes_per_step)} | {'' if step is None else f'{step:.3f}'} | "
            f"{_ratio(step, base and base.summary.step_time_s)} | {r.wall_s:.0f} |"
        )
    return "\n".join(lines)
