"""The low-communication comparison (`make lowcomm`): DDP, DiLoCo and SDP with and without DiLoCo.

    python scripts/lowcomm.py [--runs outputs/lowcomm] [--out outputs/lowcomm/tables]
                              [--tables vision language] [--seeds 0 1 2] [OVERRIDES ...]

4 CPU processes (K = 4 workers) on the tables' data and models (scripts/cpu_replica.py's: the
ResNet on Fashion-MNIST, the LLaMA on the standard library's sources), every row with every seed:

- DDP;
- DiLoCo (DDP stepping alone, outer Nesterov SGD lr 0.7, momentum 0.9) at H = 10 and 50;
- N-SDP backward at C = 0.5, without and with DiLoCo at H = 10;
- N-SDP forward and B-SDP forward at C = 0.5 with DiLoCo at H = 10.

An exploratory sweep, retired from results/: the models and steps are those of the tables before
`make tables` was sized to converge (STEPS: demo_fmnist for 160 steps, demo_text for 200, with an
evaluation at 80% of them), none tuned, and no run converges; the converged comparison is the
replica tables' DiLoCo rows (`make tables`, docs/lowcomm.md). Completed runs
are not rerun, so a partial call leaves whole seeds behind; then the tables are rebuilt from every run dir
(sdp.analysis.lowcomm).
"""

from __future__ import annotations

import sys
import time

from cpu_replica import NPROC, parse_args, table_overrides

from sdp.analysis.lowcomm import write
from sdp.launching.sweep import run_sweep

DILOCO = ["outer=diloco", "outer.sync_every=10"]
STEPS = {"vision": ("demo_fmnist", 160), "language": ("demo_text", 200)}  # table: (experiment, steps)
SWEEPS = {
    "ddp": ["variant=ddp"],
    "diloco": ["variant=ddp", "outer=diloco", "outer.sync_every=10,50"],
    "sdp": ["variant=n_sdp_backward", "masking.coverage=0.5"],
    "sdp_diloco": ["variant=n_sdp_backward,n_sdp_forward,b_sdp_forward", "masking.coverage=0.5", *DILOCO],
}


def main(argv: list[str]) -> int:
    args, extra = parse_args(argv, doc=__doc__, name="lowcomm")
    failed, start = 0, time.monotonic()
    for seed in args.seeds:
        for table in args.tables:
            for name, sweep in SWEEPS.items():
                where = args.runs / table / f"seed{seed}" / name
                experiment, steps = STEPS[table]  # evaluated at 80% of the steps and at the end
                shared = table_overrides(table, steps, eval_every=4 * steps // 5, experiment=experiment)
                jobs = [*shared, *extra, *sweep, f"seed={seed}"]
                rc = run_sweep([*jobs, f"sweep.nproc={NPROC}", f"sweep.dir={where}", f"sweep.name={table}"])
                failed += rc != 0
            print(f"lowcomm: seed {seed} of {table} done, {(time.monotonic() - start) / 60:.1f} min so far")
    for path in write(args.runs, args.out, command="python scripts/lowcomm.py (make lowcomm)"):
        print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
