"""`python -m sdp.estimate` (and `sdp-estimate`): the per-rank memory of a run, without a GPU.

    python -m sdp.estimate [group=option ...] [key=value ...] world_size=K [rank=R|busiest|all] [out=FILE.json]
                           [cluster=NAME [nodes=N] [cluster.KEY=VALUE ...]]
    python -m sdp.estimate --against RUN_DIR [rank=R|all] [out=FILE.json]

The command: its own arguments, the config, one estimate per rank asked for (`sdp.planning.estimator`,
which says how the trace works), the step on a cluster (`sdp.planning.step_time`), and the JSON file.

`rank=busiest` (the default) picks the rank that holds the most unit parameters under the mask;
`rank=all` estimates every rank in turn. `cluster=NAME` (conf/cluster/NAME.yaml; `nodes=N` spreads
the ranks over N nodes, `cluster.KEY=VALUE` overrides a field, e.g. a measured efficiency) also
models the step on that machine, serial and overlapped, for DDP and the run.

`--against RUN_DIR` re-estimates a finished run's own config for each rank it measured and
prints, per category and in total, the estimate, the measurement and their ratio
(`sdp.planning.against`, which says what is measured on CPU and on CUDA).
"""

from __future__ import annotations

import dataclasses
import json
import sys

from sdp.errors import ConfigError
from sdp.launching.cli import Usage, wants_help
from sdp.outer import is_outer
from sdp.outer.algorithms import outer_label
from sdp.paths import check_output_file
from sdp.planning.against import compare, finished_run, format_against, measured_ranks
from sdp.planning.estimates import Estimate
from sdp.planning.estimator import EstimateError, estimate, format_estimate, format_ranks
from sdp.planning.options import MAX_RANKS, EstimateArgs, parse_against, parse_estimate
from sdp.planning.ranks import busiest_rank
from sdp.planning.step_time import format_step_times, step_times
from sdp.run.config import RunConfig, load_config
from sdp.rundir import write_error
from sdp.subnet import is_sdp
from sdp.subnet.capacity import listed

USAGE = Usage(
    usage="python -m sdp.estimate [group=option ...] [key=value ...] world_size=K [rank=R|busiest|all]\n"
    "                          [out=FILE.json] [cluster=NAME [nodes=N] [cluster.KEY=VALUE ...]]\n"
    "   or: python -m sdp.estimate --against RUN_DIR [rank=R|all] [out=FILE.json]",
    about="The per-rank memory (weights, gradients, optimizer state, activations, communicators) of the run\n"
    "these overrides compose, from its own step traced without a GPU; with cluster=, its step time there.",
    keys=[
        ("world_size=K", f"the workers to play, in [1, {MAX_RANKS}] (required, unless cluster= and nodes= give it)"),
        ("rank=busiest", "an integer in [0, K - 1]; busiest (holds the most unit parameters); all (every rank)"),
        ("out=FILE.json", "also write the estimate there"),
        ("cluster=NAME", "also model the step on conf/cluster/NAME.yaml: h100_nvlink, h100_ib, h100_eth10g, ..."),
        ("nodes=N", "with cluster=: spread the ranks over N nodes"),
        ("cluster.KEY=VALUE", "with cluster=: override a field of the cluster, e.g. a measured efficiency"),
        ("--against RUN_DIR", "a finished run: its config re-estimated for each rank (rank=all, the default, or R),"),
        ("", "per category against what the run measured, with the ratio"),
    ],
    more="Every other key and group is the run's, as sdp.train takes it: python -m sdp.train --help.\n"
    "Memory figures are GiB (2**30 bytes); docs/memory.md says how far to trust them.",
    examples=[
        "python -m sdp.estimate experiment=llama_1b_fineweb world_size=8",
        "python -m sdp.estimate experiment=llama_1b_fineweb variant=n_sdp_forward masking.coverage=0.5 "
        "world_size=8 rank=all cluster=h100_nvlink",
        "python -m sdp.estimate --against outputs/llama_tiny-synthetic_text-none",
    ],
)


def ddp_overrides(overrides: list[str]) -> list[str]:
    """The DDP baseline of a run: its overrides without masking or data-parallel choices, with
    masking=none (precision, activation checkpointing and everything else kept)."""
    kept = ("parallelism.mixed_precision", "parallelism.activation_checkpointing", "parallelism.bucket_cap_mb")
    out = []
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        if key.startswith(("masking", "outer")) or key in ("variant", "trainer.protocol"):
            continue
        if key.startswith("parallelism") and key not in kept:
            continue
        out.append(o)
    return [*out, "masking=none"]


def cluster_report(args: EstimateArgs, cfg: RunConfig, est: Estimate) -> tuple[str, list[dict]]:
    """The run's step on args.cluster next to DDP's (traced as well): its text and its rows."""
    runs = [(run_label(cfg), est)]
    if is_sdp(cfg.masking.name) or cfg.parallelism.name != "ddp" or is_outer(cfg.outer):
        ddp = load_config(ddp_overrides(args.overrides), world_size=args.world_size, offline=True, check_data=False)
        runs.insert(0, ("DDP", estimate(ddp, world_size=args.world_size, rank=0)))
    rows = [{"run": label, **step_times(e, args.cluster)} for label, e in runs]
    return format_step_times(rows, args.cluster, world_size=args.world_size), rows


def run_label(cfg: RunConfig) -> str:
    knobs = dataclasses.asdict(cfg.outer)
    outer = outer_label(cfg.outer.name, sync_every=cfg.outer.sync_every, fragments=cfg.outer.fragments, knobs=knobs)
    par = "FSDP" if cfg.parallelism.name == "fsdp" and not is_sdp(cfg.masking.name) else "DDP"
    if not is_sdp(cfg.masking.name):
        return par + outer
    variant = f"{cfg.masking.granularity[0].upper()}-SDP {cfg.masking.name} C={cfg.masking.coverage:g}"
    if cfg.masking.capacity is not None:
        variant += f" capacity={listed(cfg.masking.capacity)}"
    f = cfg.parallelism.fsdp_degree if cfg.parallelism.name == "fsdp" else 1
    return variant + (f" x FSDP(F={f})" if f > 1 else "") + outer


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(USAGE.text())
        return 0
    if "--against" in argv or any(a.startswith("--against=") for a in argv):
        return against_main(argv)
    try:
        args = parse_estimate(argv)
        cfg = load_config(args.overrides, world_size=args.world_size, offline=True, check_data=False)
        if args.out:  # a place that cannot take the result is refused before the trace, not after
            check_output_file("out", args.out)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.rank == "all":
        ranks = list(range(args.world_size))
    elif args.rank == "busiest":
        ranks = [busiest_rank(cfg, world_size=args.world_size)]
    else:
        ranks = [int(args.rank)]
    if args.rank == "busiest" and args.world_size > 1:
        print(f"busiest: rank {ranks[0]} of {args.world_size} (it holds the most unit parameters)", flush=True)
    results = []
    try:
        for rank in ranks:
            results.append(estimate(cfg, world_size=args.world_size, rank=rank))
            print(format_estimate(results[-1]), flush=True)
        if len(results) > 1:
            print(format_ranks(results), flush=True)
        written = [est.to_json() for est in results]
        if args.cluster is not None:
            text, rows = cluster_report(args, cfg, results[0])
            print(text, flush=True)
            written = [{**est, "step_time": rows} for est in written]
    except EstimateError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.out:
        try:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(written if args.rank == "all" else written[0], indent=1))
        except OSError as err:  # a full disk: the estimate is printed above all the same
            print(f"error: {write_error(err, args.out)}", file=sys.stderr)
            return 2
    return 0


def against_main(argv: list[str]) -> int:
    """`--against RUN_DIR`: the run's config re-estimated for each rank asked for, against what
    the run measured; the table printed, and written as JSON to out=."""
    try:
        run_dir, wanted, out = parse_against(argv)
        cfg, measured, device = finished_run(run_dir)
        ranks = measured_ranks(measured, wanted)
        if out:
            check_output_file("out", out)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows = []
    try:
        for rank in ranks:
            est = estimate(cfg, world_size=len(measured), rank=rank, target=device)
            m = measured[rank]
            rows.append(compare(rank, est.memory, m["peak_breakdown"], m.get("cuda_max_allocated_bytes")))
            print(format_against(rows[-1:]), flush=True)
    except EstimateError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if out:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"run_dir": str(run_dir), "ranks": [r.as_dict() for r in rows]}, indent=1))
        except OSError as err:
            print(f"error: {write_error(err, out)}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
