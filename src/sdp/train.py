"""The single entrypoint: `python -m sdp.train --nproc-per-node=N [group=option ...] [key=value ...]`
(torchrun's agent in this process, `sdp.launching.torchrun`), or `torchrun --nproc_per_node=N -m sdp.train ...`.

compose config -> validate (before any process group) -> build -> train -> close (`sdp.run.runner`);
with `-m`, a sweep of such runs (`sdp.launching.sweep`); `--help`, `--cfg job` and `--config-dir DIR`
as in any Hydra app (`sdp.launching.cli`). The `sdp-train` console script is `cli()`.
"""

from __future__ import annotations

import os
import sys

from sdp import dist
from sdp.errors import ConfigError
from sdp.launching import torchrun
from sdp.launching.cli import help_text, parse_command_line, show_config
from sdp.launching.sweep import run_sweep
from sdp.run import runner
from sdp.run.preflight import preflight


def main(argv: list[str] | None = None) -> int:
    world = dist.world_from_env()
    argv = sys.argv[1:] if argv is None else argv
    try:
        options, worker_argv = torchrun.split_options(argv)  # torchrun's: this process launches the workers
        line = parse_command_line(worker_argv)
        if options and (dist.under_launcher() or line.multirun):
            name = next(iter(options))
            where = "a sweep takes sweep.nproc=N" if line.multirun else "this process is a worker of a launch already"
            raise ConfigError(f"--{name}", options[name] or None, where)
        if line.cfg:  # only a config the launch would run: the same checks first
            size = torchrun.world_size(options) if options else world.world_size
            preflight(line.overrides, dist.World(rank=0, local_rank=0, world_size=size or 1))
        if line.help or line.cfg:  # print and start nothing (every rank under torchrun; rank 0 prints)
            dist.print0(world, help_text(line.overrides) if line.help else show_config(line.overrides, line.cfg))
            return 0
    except ConfigError as err:
        dist.print0(world, f"error: {err}", file=sys.stderr)
        return 2
    if options:
        return torchrun.main(options, worker_argv, line.overrides)
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
    try:
        code = main()
    except KeyboardInterrupt:  # before any run started (a run reports its own)
        print("interrupted; no run was in progress", file=sys.stderr)
        code = 130
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    cli()
