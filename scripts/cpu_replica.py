"""CPU-scale replicas of the paper's tables (`make tables`): real offline data, tiny models.

    python scripts/cpu_replica.py [--runs outputs/cpu_replica] [--out results/cpu_replica]
                                  [--tables vision language] [--seeds 0 1 2] [OVERRIDES ...]

Each table is a set of sweeps of 4 CPU processes (K = 4 workers) over the paper's rows,
every row with every seed:

- DDP;
- N-SDP and B-SDP, backward and forward masking, at C = 0.5, under both protocols:
  same_iteration (DDP's steps) and flop_matched (1/C times the steps, the paper's);
- the dropout and stochastic-depth baselines at keep rate 0.5;
- N-SDP and B-SDP forward at C = 0.25 and 0.75, where the model admits it (llama_tiny has
  2 heads per layer: 4 workers cannot each hold a quarter of them under N-SDP).

The same data for every row. The issue asks for steps at which DDP's eval metric moves by
less than 1% over the last 20% of its steps; the steps per table (160 and 200) are what fits
the 3-hour budget of both tables on a 2-core machine, and there DDP still moves by 0.4 to 5.1%
(vision) and 1.9% (language): each table's header states the check and its result. Seeds
are the outer loop, so a partial call leaves whole seeds behind. The runs stay in --runs:
a second call skips completed runs and resumes stopped ones, then rebuilds the tables and
claims.md (`python -m sdp.collect --claims` reads the same run dirs).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from sdp.analysis.tables import collect
from sdp.launching.sweep import run_sweep

NPROC = 4
# The memory claims also read the estimator's table and the H200 measurements.
MEMORY_TABLE = Path("results/tables/memory_estimates.csv")
CUDA = Path("results/bench/cuda_memory_*.json")
# table: (experiment, DDP's steps). Evaluation at 80% of the steps and at the end gives the
# convergence check its two points.
TABLES = {
    # Vision: ResNet on Fashion-MNIST (the paper's ResNet-18 / CIFAR rows).
    "vision": ("demo_fmnist", 160),
    # Language: LLaMA on the Python standard library's sources (the paper's LLaMA / FineWeb rows).
    "language": ("demo_text", 200),
}
SDP = "variant=n_sdp_backward,n_sdp_forward,b_sdp_backward,b_sdp_forward"
SWEEPS = {
    "ddp": [["variant=ddp"]],
    "c0.5": [[f"{SDP},dropout,stochastic_depth", "masking.coverage=0.5"]],
    "flop_matched": [[SDP, "masking.coverage=0.5", "trainer.protocol=flop_matched"]],
}
COVERAGE = {
    "vision": [["variant=n_sdp_forward,b_sdp_forward", "masking.coverage=0.25,0.75"]],
    "language": [
        ["variant=b_sdp_forward", "masking.coverage=0.25,0.75"],
        ["variant=n_sdp_forward", "masking.coverage=0.75"],
    ],
}


def table_overrides(table: str) -> list[str]:
    experiment, steps = TABLES[table]
    return [
        f"experiment={experiment}",
        f"trainer.max_steps={steps}",
        f"trainer.eval_every={4 * steps // 5}",
        "trainer.progress=false",
        "logger=none",
    ]


def parse_args(argv: list[str], *, doc: str, name: str) -> tuple[argparse.Namespace, list[str]]:
    """--runs outputs/NAME, --out results/NAME, --tables, --seeds (0 1 2); the rest are overrides."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--runs", type=Path, default=Path(f"outputs/{name}"))
    parser.add_argument("--out", type=Path, default=Path(f"results/{name}"))
    parser.add_argument("--tables", nargs="+", choices=list(TABLES), default=list(TABLES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    return parser.parse_known_args(argv)


def main(argv: list[str]) -> int:
    args, extra = parse_args(argv, doc=__doc__, name="cpu_replica")
    failed, start = 0, time.monotonic()
    for seed in args.seeds:
        for table in args.tables:
            for name, sweeps in {**SWEEPS, "coverage": COVERAGE[table]}.items():
                for i, sweep in enumerate(sweeps):
                    where = args.runs / table / f"seed{seed}" / (name if i == 0 else f"{name}{i}")
                    jobs = [*table_overrides(table), *extra, *sweep, f"seed={seed}"]
                    rc = run_sweep([*jobs, f"sweep.nproc={NPROC}", f"sweep.dir={where}", f"sweep.name={table}"])
                    failed += rc != 0
            print(f"cpu_replica: seed {seed} of {table} done, {(time.monotonic() - start) / 60:.1f} min so far")
    command = "python scripts/cpu_replica.py (make tables)"
    memory = dict(memory_table=MEMORY_TABLE, cuda=tuple(sorted(CUDA.parent.glob(CUDA.name))))
    for path in collect([args.runs / t for t in args.tables], args.out, command=command, claims=True, **memory):
        print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
