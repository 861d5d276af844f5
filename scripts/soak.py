"""CPU soak (`make soak`): many short runs in one sweep, one of them made to fail.

    python scripts/soak.py [--seeds 8] [--nproc 2] [--dir outputs/soak] [OVERRIDES ...]

The sweep runs llama_tiny on the standard library's sources for every seed x
{DDP, N-SDP forward, B-SDP backward} at C = 0.5 (checkpointing every 3 steps), plus one job
whose learning rate makes it diverge (a NaN loss at step 2). It checks that
every other job completed with finite losses and its checkpoints, that the
diverged job alone is `failed` in sweep.json with its reason and its
diagnostic file, and that no process or partial checkpoint was left behind;
then it prints one line per check, the wall time and the jobs per minute.
Exit code 0 when every check holds.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from sdp.launching.sweep import execute, plan
from sdp.rundir import METRICS

BASE = [
    "experiment=demo_text",
    "dataset.seq_len=64",
    "trainer.global_batch_size=16",
    "trainer.max_steps=8",
    "trainer.eval_every=0",
    "trainer.log_every=1",
    "trainer.checkpoint_every=3",
    "dataset.eval_batches=1",
    "trainer.progress=false",
    "logger=none",
]
DIVERGES = ["variant=ddp", "optim.lr=1e30", "optim.warmup_steps=0", "seed=0"]


def checks(jobs: list[dict], failing_index: int, root: Path) -> list[tuple[bool, str]]:
    out = []
    others = [j for j in jobs if j["index"] != failing_index]
    done = [j for j in others if j["status"] == "completed"]
    out.append((len(done) == len(others), f"{len(done)} of {len(others)} healthy jobs completed"))
    finite = 0
    for job in done:
        records = [json.loads(line) for line in (Path(job["run_dir"]) / METRICS).read_text().splitlines()]
        finite += all(math.isfinite(r["train_loss"]) for r in records if "train_loss" in r)
    out.append((finite == len(done), f"{finite} of {len(done)} completed jobs logged only finite losses"))
    bad = next(j for j in jobs if j["index"] == failing_index)
    reason = bad.get("error") or ""
    out.append(
        (
            bad["status"] == "failed" and bad["exit_code"] not in (0, None) and "non-finite" in reason,
            f"the diverging job is '{bad['status']}' with exit code {bad['exit_code']}: {reason[:90]}",
        )
    )
    diagnostic = list(Path(bad["run_dir"]).glob("nonfinite_step_*.json"))
    out.append((len(diagnostic) == 1, f"its diagnostic: {', '.join(p.name for p in diagnostic) or 'missing'}"))
    partial = list(root.glob("*/checkpoints/*.partial"))
    out.append((not partial, f"{len(partial)} partial checkpoints left"))
    return out


def leftover_processes(root: Path) -> int:
    """Training processes (torchrun or its workers) of this soak's jobs still alive (none should be)."""
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return sum("sdp.train" in line and f"run_dir={root}" in line for line in ps.splitlines())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=Path(f"outputs/soak/{time.strftime('%Y%m%d-%H%M%S')}"))
    args, extra = parser.parse_known_args(argv)
    sweep = [*BASE, *extra, f"seed=range(0,{args.seeds})", "variant=ddp,n_sdp_forward,b_sdp_backward"]
    jobs = plan(sweep, root=args.dir, nproc=args.nproc)
    failing = plan([*BASE, *extra, *DIVERGES], root=args.dir, nproc=args.nproc, start=len(jobs))
    jobs += failing
    start = time.perf_counter()
    rc = execute(jobs, root=args.dir, nproc=args.nproc)
    wall = time.perf_counter() - start
    recorded = json.loads((args.dir / "sweep.json").read_text())
    results = checks(recorded, failing[0].index, args.dir)
    left = leftover_processes(args.dir)
    results.append((left == 0, f"{left} training processes left behind"))
    results.append((rc == 1, f"the sweep exited with {rc} (1: a job failed)"))
    print(f"\nsoak: {len(jobs)} jobs x {args.nproc} processes in {wall:.0f} s ({60 * len(jobs) / wall:.1f} jobs/min)")
    for ok, text in results:
        print(f"  [{'ok' if ok else 'FAIL'}] {text}")
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
