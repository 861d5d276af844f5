"""The single entrypoint: `torchrun --nproc_per_node=N -m sdp.train [group=option ...] [key=value ...]`.

compose config -> validate (before any process group) -> build -> train -> close (`sdp.runner`);
with `-m`, a sweep of such runs (`sdp.sweep`).
"""

from __future__ import annotations

import os
import sys

from sdp import dist, runner
from sdp.sweep import run_sweep


def main(argv: list[str] | None = None) -> int:
    overrides = sys.argv[1:] if argv is None else argv
    world = dist.world_from_env()
    if "-m" in overrides or "--multirun" in overrides:  # a sweep: one torchrun launch per job
        if dist.under_launcher():
            dist.print0(
                world, "error: -m: start a sweep with python -m sdp.train -m ..., not under torchrun", file=sys.stderr
            )
            return 2
        return run_sweep([o for o in overrides if o not in ("-m", "--multirun")])
    return runner.main(overrides)


if __name__ == "__main__":
    code = main()
    # Everything is written and the process group is gone: leave without the interpreter's
    # teardown, where a gloo thread still owned by a collected process group occasionally
    # aborts the process ("terminate called without an active exception", ~1 run in 12 with
    # FSDP on CPU), which would turn a finished run into a failed job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
