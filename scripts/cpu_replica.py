"""CPU-scale replicas of the paper's tables (`make tables`): real offline data, tiny models.

    python scripts/cpu_replica.py [--runs outputs/cpu_replica] [--out results/cpu_replica]
                                  [--tables vision language] [OVERRIDES ...]

Each table is a sweep of 4 CPU processes (K = 4 workers) over the paper's rows:
DDP; N-SDP and B-SDP with backward and forward masking at C = 0.5; the dropout
and stochastic-depth baselines at keep rate 0.5; N-SDP and B-SDP forward at
C = 0.5 under the paper's flop_matched protocol (twice the steps); and one
forward variant at C = 0.25 and 0.75 for quality against coverage. The same
data and seed for every row, the same steps unless flop_matched. The runs stay in --runs: a second call only rebuilds
the tables (completed runs are skipped), and `python -m sdp.collect` reads them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sdp.collect import collect
from sdp.sweep import run_sweep

NPROC = 4
TABLES = {
    # Vision: ResNet on Fashion-MNIST (the paper's ResNet-18 / CIFAR rows).
    "vision": ["experiment=demo_fmnist", "trainer.max_steps=120", "trainer.eval_every=0"],
    # Language: LLaMA on the Python standard library's sources (the paper's LLaMA / FineWeb rows).
    "language": ["experiment=demo_text", "trainer.max_steps=150", "trainer.eval_every=0"],
}
SWEEPS = {
    "ddp": ["variant=ddp"],
    "c0.5": [
        "variant=n_sdp_backward,n_sdp_forward,b_sdp_backward,b_sdp_forward,dropout,stochastic_depth",
        "masking.coverage=0.5",
    ],
    # The paper's protocol: forward masking gets 1/C the steps, so its compute matches DDP's.
    "flop_matched": ["variant=n_sdp_forward,b_sdp_forward", "masking.coverage=0.5", "trainer.protocol=flop_matched"],
}
# Quality against coverage, with a variant every worker can hold at C = 0.25 (llama_tiny has
# 2 heads per layer: 4 workers cannot each hold a quarter of them).
COVERAGE = {"vision": "variant=n_sdp_forward", "language": "variant=b_sdp_forward"}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=Path, default=Path("outputs/cpu_replica"))
    parser.add_argument("--out", type=Path, default=Path("results/cpu_replica"))
    parser.add_argument("--tables", nargs="+", choices=list(TABLES), default=list(TABLES))
    args, extra = parser.parse_known_args(argv)
    failed = 0
    for table in args.tables:
        sweeps = {**SWEEPS, "coverage": [COVERAGE[table], "masking.coverage=0.25,0.75"]}
        for name, sweep in sweeps.items():
            base = [*TABLES[table], "trainer.progress=false", "logger=none", *extra]
            rc = run_sweep([*base, *sweep, f"sweep.nproc={NPROC}", f"sweep.dir={args.runs / table / name}"])
            failed += rc != 0
    command = "python scripts/cpu_replica.py (make tables)"
    for path in collect([args.runs / t for t in args.tables], args.out, command=command):
        print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
