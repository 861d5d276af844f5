"""`python -m sdp.train --nproc-per-node=N [torchrun options] [overrides]`: torchrun's elastic
agent started by the entrypoint itself, so a launch behaves as its documentation says.

- The config is checked here, for the world the options give (N x nodes), before any
  worker or process group starts: bad input is the entrypoint's one `error: KEY=VALUE: ...`
  line and exit code 2, not that line followed by torchrun's `ChildFailedError` traceback
  and exit code 1. (An elastic `--nnodes=MIN:MAX` has no world size yet; the workers check
  it then, and their exit code passes through.)
- A worker's own exit codes pass through without a traceback: 2 (bad input), 3 (a diagnosed
  failure, already one line), 130 (Ctrl-C: the run stopped with a checkpoint and said how to
  resume). Any other failure is one line naming the rank and its exit code or signal.
- Ctrl-C reaches every worker, which stops after its current log step with a checkpoint
  (`sdp.run.signals.StopSignals`); the agent waits `--shutdown-timeout` seconds (here 120 by
  default, torchrun's 30) for that before it kills them.

The options are torchrun's, spelled as torchrun spells them; `torch.distributed.run` parses
them. A plain `torchrun -m sdp.train ...` still works, with torchrun's own messages.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import determine_local_world_size, parse_args, run

from sdp import dist
from sdp.errors import ConfigError
from sdp.run.preflight import preflight

# torchrun's options that take a value, and those that do not (both spellings are accepted).
VALUE_OPTIONS = (
    "nproc-per-node",
    "nnodes",
    "node-rank",
    "master-addr",
    "master-port",
    "rdzv-backend",
    "rdzv-endpoint",
    "rdzv-id",
    "rdzv-conf",
    "max-restarts",
    "monitor-interval",
    "start-method",
    "local-addr",
    "log-dir",
    "redirects",
    "tee",
    "local-ranks-filter",
    "shutdown-timeout",
)
SWITCHES = ("standalone",)
SHUTDOWN_TIMEOUT_S = 120
# A worker's exit codes that it has explained in one line already.
REPORTED = {2: "bad input", 3: "a diagnosed failure", 130: "interrupted"}


def option_name(arg: str) -> str | None:
    """The torchrun option `arg` starts (dashes normalized: --nproc_per_node is nproc-per-node), if any."""
    if not arg.startswith("--"):
        return None
    name = arg[2:].partition("=")[0].replace("_", "-")
    return name if name in VALUE_OPTIONS or name in SWITCHES else None


def split_options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """torchrun's options (name -> value, '' for a switch) apart from the rest of the command line."""
    options, rest, args = {}, [], iter(argv)
    for arg in args:
        name = option_name(arg)
        if name is None:
            rest.append(arg)
        elif name in SWITCHES:
            options[name] = ""
        else:
            _, eq, value = arg.partition("=")
            value = value if eq else next(args, None)
            if value is None:
                raise ConfigError(f"--{name}", None, "needs a value")
            options[name] = value
    return options, rest


def _whole(options: dict[str, str], name: str, low: int) -> int | None:
    value = options.get(name)
    if value is None:
        return None
    if not re.fullmatch(r"[0-9]+", value.strip()) or int(value) < low:
        raise ConfigError(f"--{name}", value, f"must be a whole number >= {low}")
    return int(value)


def world_size(options: dict[str, str]) -> int | None:
    """The world the options give: processes per node x nodes; None while elastic (MIN:MAX nodes)."""
    nproc = options.get("nproc-per-node", "1")
    if re.fullmatch(r"[0-9]+", nproc.strip()):
        local = _whole(options, "nproc-per-node", 1)
    else:
        try:
            local = determine_local_world_size(nproc)  # gpu, auto, cpu... as torchrun counts them
        except ValueError as err:
            raise ConfigError(
                "--nproc-per-node", nproc, f"must be a whole number >= 1, or gpu/auto/cpu ({err})"
            ) from None
        if local < 1:  # torchrun takes "-1" as a count
            raise ConfigError("--nproc-per-node", nproc, "must be a whole number >= 1, or gpu/auto/cpu")
    for name in ("max-restarts", "shutdown-timeout", "node-rank", "master-port"):
        _whole(options, name, 0)
    nodes = options.get("nnodes", "1")
    if re.fullmatch(r"[0-9]+", nodes.strip()):
        return local * _whole({"nnodes": nodes}, "nnodes", 1)
    low, sep, high = nodes.partition(":")
    if not (sep and low.isdigit() and high.isdigit() and 0 < int(low) <= int(high)):
        raise ConfigError(
            "--nnodes", nodes, "must be a number of nodes N >= 1, or a range MIN:MAX with 1 <= MIN <= MAX"
        )
    return local * int(low) if low == high else None


def torchrun_argv(options: dict[str, str], worker_argv: list[str]) -> list[str]:
    """The torchrun command line that starts `python -m sdp.train WORKER_ARGV` on every worker."""
    options = {"shutdown-timeout": str(SHUTDOWN_TIMEOUT_S), **options}
    if "rdzv-endpoint" not in options and "master-addr" not in options and options.get("nnodes", "1") == "1":
        options.setdefault("standalone", "")
    flags = [f"--{k}" if k in SWITCHES else f"--{k}={v}" for k, v in options.items()]
    return [*flags, "--module", "sdp.train", *worker_argv]


def main(options: dict[str, str], worker_argv: list[str], overrides: list[str]) -> int:
    """Check the config for the launch's world, then run the workers under torchrun's agent in
    this process; the exit code as the module docstring says."""
    try:
        size = world_size(options)
        if size is not None:
            preflight(overrides, dist.World(rank=0, local_rank=0, world_size=size))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    return _run_agent(torchrun_argv(options, worker_argv))


def _run_agent(argv: list[str]) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its banner
    for name in list(logging.root.manager.loggerDict):  # the workers say what happened, in one line
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        run(parse_args(argv))
    except ChildFailedError as err:  # the lowest rank that exited on its own, else the first stopped
        failures = sorted(err.failures.items(), key=lambda item: (item[1].exitcode < 0, item[0]))
        rank, failure = failures[0]
        return _explain(rank, failure.exitcode)
    except SignalException as err:  # the workers had the signal too, and have said where they stopped
        return 128 + int(err.sigval)
    except KeyboardInterrupt:
        return 130
    return 0


def _explain(rank: int, code: int) -> int:
    """The launch's exit code for a failed worker, with one line unless the worker gave one."""
    if code in REPORTED:
        return code
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        hint = " (out of host memory?)" if name == "SIGKILL" else ""
        print(f"error: rank {rank} was killed by {name}{hint}; its output is above", file=sys.stderr, flush=True)
        return 128 - code
    print(f"error: rank {rank} exited with code {code}; its output is above", file=sys.stderr, flush=True)
    return 1
