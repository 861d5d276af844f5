"""The single entrypoint: `torchrun --nproc_per_node=N -m sdp.train [group=option ...] [key=value ...]`.

compose config -> validate (before any process group) -> build -> train -> close (`sdp.runner`);
with `-m`, a sweep of such runs (`sdp.sweep`); `--help`, `--cfg job` and `--config-dir DIR`
as in any Hydra app (`sdp.cli`). The `sdp-train` console script is `cli()`.
"""

from __future__ import annotations

import os
import sys

from sdp import dist, runner
from sdp.cli import help_text, parse_command_line, show_config
from sdp.errors import ConfigError
from sdp.sweep import run_sweep


def main(argv: list[str] | None = None) -> int:
    world = dist.world_from_env()
    try:
        line = parse_command_line(sys.argv[1:] if argv is None else argv)
        if line.help or line.cfg:  # print and start nothing (every rank under torchrun; rank 0 prints)
            dist.print0(world, help_text(line.overrides) if line.help else show_config(line.overrides, line.cfg))
            return 0
    except ConfigError as err:
        dist.print0(world, f"error: {err}", file=sys.stderr)
        return 2
    if line.multirun:  # a sweep: one torchrun launch per job
        if dist.under_launcher():
            dist.print0(
                world, "error: -m: start a sweep with python -m sdp.train -m ..., not under torchrun", file=sys.stderr
            )
            return 2
        return run_sweep(line.overrides)
    return runner.main(line.overrides)


def cli() -> None:
    """`sdp-train` and `python -m sdp.train`: main, then leave at once.

    Everything is written and the process group is gone: leave without the interpreter's
    teardown, where a gloo thread still owned by a collected process group occasionally
    aborts the process ("terminate called without an active exception", ~1 run in 12 with
    FSDP on CPU), which would turn a finished run into a failed job."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    cli()
