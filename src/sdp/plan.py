"""`python -m sdp.plan` (and `sdp-plan`): from "these are my GPUs" to the command that fits and runs fastest.

    python -m sdp.plan [group=option ...] [key=value ...] devices=8x80|[80,...,24]|4x80+4x24
                       [cluster=NAME [nodes=N] [cluster.KEY=VALUE ...]]
                       [objective=speed|memory|time_to_target [quality=PILOT]] [min_coverage=0.3]
                       [coverages=grid|all] [granularity=neuron,block]
                       [precision=fp32,bf16] [checkpointing=none,selective,full] [top=20|all]
                       [workers=N] [world_size=K] [out=DIR] [cache=DIR|off]

The run's own overrides (model, dataset, seq_len, global batch, optimizer ...) are kept; what the
planner chooses (masking, parallelism, FSDP degree, activation checkpointing, precision, gradient
accumulation) is refused on its command line, with the planner's own key that narrows it.
The command prints; `sdp.planning.options` parses its line (and `sdp.estimate`'s),
`sdp.planning.planner` runs the plan. docs/plan.md says how it searches, and how far to trust it.
"""

from __future__ import annotations

import sys

from sdp.errors import ConfigError
from sdp.launching.cli import Usage, wants_help
from sdp.planning.options import MIN_COVERAGE
from sdp.planning.planner import header, make_plan, nothing_fits, pilot_line, prepare, save, space_of
from sdp.planning.traces import default_dir

USAGE = Usage(
    usage="python -m sdp.plan [group=option ...] [key=value ...] devices=8x80|[80,...,24]|4x80+4x24\n"
    "                      [cluster=NAME [nodes=N] [cluster.KEY=VALUE ...]] [objective=speed|memory] [KEY=VALUE ...]",
    about="From these GPUs to the run that fits them and runs fastest: every structure (DDP, FSDP, SDP's\n"
    "modes and coverages, SDP x FSDP, activation checkpointing, bf16) fitted to the devices at its\n"
    "largest micro-batch, ranked, each row with its sdp.train command.",
    keys=[
        ("devices=...", "required: the GPUs' memory in GiB (2**30 bytes): 8x80, [80,80,24,24] or 4x80+4x24"),
        ("cluster=NAME", "the step-time model, conf/cluster/NAME.yaml: h100_nvlink, h100_ib, h100_eth10g, ..."),
        ("nodes=N", "with cluster=: the nodes the GPUs are on"),
        ("cluster.KEY=VALUE", "with cluster=: override a field of the cluster"),
        ("objective=speed", "speed (needs cluster=): the most tokens or samples per second; memory: the lowest peak;"),
        ("", "time_to_target (needs cluster= and quality=): the least time to a pilot's target quality"),
        ("quality=PILOT", "objective=time_to_target's pilot sweep: a collect CSV, or a folder of one table's run dirs"),
        (f"min_coverage={MIN_COVERAGE}", "the lowest SDP coverage searched, in (0, 1]"),
        ("coverages=grid", "grid: 0.75, 0.5, 0.25, 0.125; all: every r / K"),
        ("granularity=...", "neuron,block (a LLaMA's default: neuron)"),
        ("precision=fp32,bf16", "the precisions searched"),
        ("checkpointing=none,selective,full", "the activation checkpointing searched"),
        ("sync_every=1,10,50,100", "with outer=diloco: the H searched (DDP and SDP rows also without it)"),
        ("top=20", "the rows printed (an integer, or all)"),
        ("workers=N", "processes that trace in parallel (default: the CPUs this process may use, 1.2 GiB each)"),
        ("world_size=K", "optional: must equal the number of devices"),
        ("out=DIR", "also write DIR/plan.json and DIR/pareto.png"),
        ("cache=DIR|off", f"keep traces for the next call in DIR (default {default_dir()}); off: trace everything"),
    ],
    more="Every other key and group is the run's, as sdp.train takes it (python -m sdp.train --help);\n"
    "what the planner chooses (masking, parallelism, precision, checkpointing, accumulation) is refused\n"
    "there. docs/plan.md says how it searches, and how far to trust it.",
    examples=[
        "python -m sdp.plan experiment=llama_1b_fineweb devices=8x80 cluster=h100_nvlink",
        "python -m sdp.plan experiment=llama_1b_fineweb devices=4x80+4x24 objective=memory top=5 out=plan/",
    ],
)


def say(line: str) -> None:
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(USAGE.text())
        return 0
    try:
        args, composer, plain = prepare(argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    space = space_of(args, plain)
    say(header(args, plain, len(space)))
    say(pilot_line(args))
    plan = make_plan(args, composer, plain, space, say=say)
    say(plan.summary())
    say(plan.traces_line())
    if plan.best:
        say(plan.table())
    if args.out is not None:
        say(f"wrote {' and '.join(save(plan))}")
    if not plan.best:
        print(f"error: {nothing_fits(args, plan.rows)}", file=sys.stderr)
        return 2
    return 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
