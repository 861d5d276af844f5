"""`python -m sdp.plan` (and `sdp-plan`): from "these are my GPUs" to the command that fits and runs fastest.

    python -m sdp.plan [group=option ...] [key=value ...] devices=8x80|[80,...,24]|4x80+4x24
                       [cluster=NAME [nodes=N] [cluster.KEY=VALUE ...]] [objective=speed|memory]
                       [min_coverage=0.3] [coverages=grid|all] [granularity=neuron,block]
                       [precision=fp32,bf16] [checkpointing=none,selective,full] [top=20|all]
                       [workers=2] [world_size=K] [out=DIR]

The run's own overrides (model, dataset, seq_len, global batch, optimizer ...) are kept; what the
planner chooses (masking, parallelism, FSDP degree, activation checkpointing, precision, gradient
accumulation) is refused on its command line, with the planner's own key that narrows it.
`sdp.planning.space` lists the structures, `sdp.planning.search` fits each to the devices,
`sdp.planning.report` ranks and shows them; docs/plan.md says how, and how far to trust it.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sdp.errors import ConfigError
from sdp.launching.cli import Usage, wants_help
from sdp.outer import is_outer
from sdp.paths import check_writable
from sdp.planning.fit import GIB
from sdp.planning.layered import extends
from sdp.planning.report import OBJECTIVES, format_rows, nearest_miss, plot, ranked, row, sources, write_json
from sdp.planning.search import Composer, Outcome, search, verify
from sdp.planning.space import CHECKPOINTING, PRECISIONS, SYNC_EVERY, parse_devices, structures
from sdp.planning.step_time import Cluster, load_cluster, place
from sdp.planning.traces import TraceCache, default_dir
from sdp.run.config import RunConfig, validate

MIN_COVERAGE = 0.3  # the default: below it quality fell in our replica tables (claims_before.md, claim 4a)
OWN = (
    "devices", "cluster", "nodes", "objective", "min_coverage", "coverages", "granularity",
    "precision", "checkpointing", "top", "workers", "world_size", "out", "sync_every", "cache",
)  # fmt: skip
CHOSEN = {  # the planner's choices, and the planner's key that narrows each
    "masking": "min_coverage=, coverages=, granularity=",
    "variant": "min_coverage=, coverages=, granularity=",
    "parallelism": "the table's FSDP rows",
    "parallelism.fsdp_degree": "the table's SDP x FSDP rows",
    "parallelism.activation_checkpointing": "checkpointing=",
    "parallelism.mixed_precision": "precision=",
    "trainer.grad_accum_steps": "the table's micro-batch column (trainer.global_batch_size= sets the batch)",
    "outer.sync_every": "sync_every=",
}

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
        ("objective=speed", "speed (needs cluster=): the most tokens or samples per second; memory: the lowest peak"),
        (f"min_coverage={MIN_COVERAGE}", "the lowest SDP coverage searched, in (0, 1]"),
        ("coverages=grid", "grid: 0.75, 0.5, 0.25, 0.125; all: every r / K"),
        ("granularity=...", "neuron,block (a LLaMA's default: neuron)"),
        ("precision=fp32,bf16", "the precisions searched"),
        ("checkpointing=none,selective,full", "the activation checkpointing searched"),
        ("sync_every=1,10,50,100", "with outer=diloco: the H searched (DDP and SDP rows also without it)"),
        ("top=20", "the rows printed (an integer, or all)"),
        ("workers=2", "processes that trace in parallel"),
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


@dataclass
class PlanArgs:
    overrides: list[str]
    devices: list[float]
    devices_text: str
    cluster: Cluster | None
    nodes: int
    objective: str
    min_coverage: float
    every: bool  # coverages=all
    granularities: tuple[str, ...] | None  # None: the default for the model
    precisions: tuple[str, ...]
    checkpointing: tuple[str, ...]
    sync_every: tuple[int, ...] | None  # outer=diloco's H searched (None: not given; (): no outer loop)
    top: int
    workers: int
    out: Path | None
    cache: Path | None  # where traces are kept between calls (None: cache=off)


def _choices(key: str, value: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    picked = tuple(v.strip() for v in value.split(","))
    if not all(picked) or not set(picked) <= set(allowed) or len(set(picked)) != len(picked):
        raise ConfigError(key, value, f"must be a comma list of {', '.join(allowed)}")
    return picked


def _number(key: str, value: str, lo: float, hi: float, *, whole: bool = False) -> float:
    try:
        number = int(value) if whole else float(value)
    except ValueError:
        number = None
    if number is None or not lo <= number <= hi:
        raise ConfigError(key, value, f"must be {'an integer' if whole else 'a number'} in [{lo:g}, {hi:g}]")
    return number


def _sync_every(value: str) -> tuple[int, ...]:
    picked = tuple(v.strip() for v in value.split(","))
    if not all(p.isdigit() and int(p) >= 1 for p in picked) or len(set(map(int, picked))) != len(picked):
        raise ConfigError("sync_every", value, "must be a comma list of distinct integers >= 1 (outer=diloco's H)")
    return tuple(map(int, picked))


def _split(argv: list[str]) -> tuple[dict, list[str], dict]:
    own, overrides, cluster_keys = {}, [], {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in OWN:
            own[key] = value
        elif sep and key.startswith("cluster."):
            cluster_keys[key.removeprefix("cluster.")] = value
        else:
            bare = key.lstrip("+~")
            chosen = bare if bare in CHOSEN else "masking" if bare.startswith("masking.") else None
            if sep and chosen is not None:
                raise ConfigError(key, value, f"is the planner's to choose; narrow it with {CHOSEN[chosen]}")
            overrides.append(arg)
    return own, overrides, cluster_keys


def parse_args(argv: list[str]) -> PlanArgs:
    own, overrides, cluster_keys = _split(argv)
    if "devices" not in own:
        raise ConfigError("devices", None, "is required: devices=8x80, [80,80,24,24] or 4x80+4x24 (GiB per GPU)")
    devices = parse_devices(own["devices"])
    world = len(devices)
    if "world_size" in own and own["world_size"] != str(world):
        raise ConfigError("devices", own["devices"], f"lists {world} GPUs, but world_size={own['world_size']}")
    cluster, nodes = None, 1
    if "cluster" in own:
        cluster = load_cluster(own["cluster"], cluster_keys)
        wanted = int(_number("nodes", own["nodes"], 1, world, whole=True)) if "nodes" in own else None
        place(cluster, world_size=world, nodes=wanted)
        per_node = cluster.ranks_per_node
        if world > per_node and world % per_node:  # torchrun starts as many ranks on every node
            fits = [n for n in range(2, world + 1) if world % n == 0 and world // n <= per_node]
            raise ConfigError(
                "devices", own["devices"], f"has {world} GPUs: not whole nodes of {per_node}; give nodes=N, N in {fits}"
            )
        nodes = max(1, world // per_node)
    elif cluster_keys or "nodes" in own:
        raise ConfigError("cluster", None, "is required with nodes= and cluster.KEY=")
    objective = own.get("objective", "speed")
    if objective not in OBJECTIVES:
        raise ConfigError("objective", objective, f"allowed: {', '.join(OBJECTIVES)}")
    if objective == "speed" and cluster is None:
        raise ConfigError("cluster", None, "is required for objective=speed (the step time); or objective=memory")
    if own.get("coverages", "grid") not in ("grid", "all"):
        raise ConfigError("coverages", own["coverages"], "allowed: grid (0.75, 0.5, 0.25, 0.125), all (every r / K)")
    top = own.get("top", "20")
    return PlanArgs(
        overrides,
        devices,
        own["devices"],
        cluster,
        nodes,
        objective,
        _number("min_coverage", own.get("min_coverage", str(MIN_COVERAGE)), 1e-6, 1),
        own.get("coverages") == "all",
        _choices("granularity", own["granularity"], ("neuron", "block")) if "granularity" in own else None,
        _choices("precision", own.get("precision", ",".join(PRECISIONS)), PRECISIONS),
        _choices("checkpointing", own.get("checkpointing", ",".join(CHECKPOINTING)), CHECKPOINTING),
        _sync_every(own["sync_every"]) if "sync_every" in own else None,
        10**9 if top == "all" else int(_number("top", top, 1, 10**6, whole=True)),
        int(_number("workers", own.get("workers", str(min(2, os.cpu_count() or 1))), 1, 64, whole=True)),
        Path(own["out"]) if "out" in own else None,
        _cache(own.get("cache")),
    )


def _cache(value: str | None) -> Path | None:
    """cache=: the folder for traces (the default's need not be writable: without it the plan is
    only slower), or None for off."""
    if value is None:
        return default_dir()
    if value == "off":
        return None
    if not value.strip():
        raise ConfigError("cache", value, "must be a folder, or off (trace everything)")
    check_writable("cache", Path(value))
    return Path(value)


def run_facts(args: PlanArgs, cfg: RunConfig) -> dict:
    """What every row shares: the user's overrides, the world, the work of a step."""
    text = cfg.dataset.kind == "text"
    per_step = cfg.trainer.global_batch_size * (cfg.dataset.seq_len if text else 1)
    return {
        "overrides": args.overrides,
        "world": len(args.devices),
        "protocol": cfg.trainer.protocol,
        "unit": "tokens" if text else "samples",
        "per_step": per_step,
    }


def describe_devices(devices: list[float]) -> str:
    return " + ".join(f"{len(list(run))} x {gib:g}" for gib, run in itertools.groupby(devices)) + " GiB"


def header(args: PlanArgs, cfg: RunConfig, n: int) -> str:
    machine = "no cluster (memory only)"
    if args.cluster is not None:
        machine = f"{args.cluster.name}, {args.nodes} node(s) of {args.cluster.ranks_per_node}"
    seq = f" x seq {cfg.dataset.seq_len}" if cfg.dataset.kind == "text" else ""
    return (
        f"plan: model={cfg.model.name}, global batch {cfg.trainer.global_batch_size}{seq}, on "
        f"{describe_devices(args.devices)} ({machine}); objective {args.objective}; {n} structures"
    )


def progress_line(outcome: Outcome, done: int, total: int) -> None:
    found, label = outcome.found, outcome.structure.label
    if found is None:
        what = f"refused: {outcome.reason}"
    else:
        busiest = max(found.peaks, key=lambda r: found.peaks[r] / found.gib[r])
        peak, gib = found.peaks[busiest] / GIB, found.gib[busiest]
        fits = f"fits at micro-batch {found.micro} x {found.accum}" if found.fits else "does not fit at micro-batch 1"
        how = f"from {outcome.lead.label}'s traces" if outcome.lead else f"{found.probes} probes"
        what = f"{fits}, peak {peak:.2f} / {gib:g} GiB ({how}, {outcome.seconds:.1f} s)"
    print(f"[{done}/{total}] {label}: {what}", file=sys.stderr, flush=True)


def nothing_fits(args: PlanArgs, rows: list[dict]) -> str:
    """The one-line refusal when no row fits: the smallest peak and what would make it fit."""
    miss = nearest_miss(rows)
    if miss is None:
        first = next(r["refused"] for r in rows)
        return f"devices={args.devices_text!r}: nothing can be planned: every structure is refused, e.g. {first}"
    gib, b = miss["devices_gib"][miss["busiest_rank"]], miss["breakdown_gib"]
    static = b["weights"] + b["grads"] + b["optimizer"] + (miss["peak_gib"] - b["total"])
    ways = []
    if static < gib:
        share = (gib - static) / max(b["activations"] + b["temporaries"], 1e-9)
        ways.append(f"fewer tokens per rank (about {share:.0%} of them: a shorter dataset.seq_len or image)")
    else:
        ways.append(f"more devices (weights, gradients, optimizer state and communicators alone take {static:.3g} GiB)")
    k = len(args.devices)
    searched = [r["structure"]["coverage"] for r in rows if r["structure"]["masking"] != "none"]
    if searched and 1 / k < min(c for c in searched if c) - 1e-9:  # r / K: 1 / K is the lowest K gives
        ways.append(f"a lower coverage (min_coverage={1 / k:g} coverages=all: C = 1/{k} is the lowest {k} GPUs give)")
    return (
        f"devices={args.devices_text!r}: nothing fits: the smallest peak is {miss['peak_gib']:.3g} GiB on a "
        f"{gib:g} GiB GPU ({miss['run']}, micro-batch 1, rank {miss['busiest_rank']}); to fit, try "
        + ", or ".join(ways)
    )


def prepare(argv: list[str]) -> tuple[PlanArgs, Composer, RunConfig]:
    """The arguments, the composer, and the run's plain config, checked: every refusal of a bad
    input, before any trace."""
    args = parse_args(argv)
    composer = Composer(args.overrides, world=len(args.devices))
    plain = composer.base("none", "ddp")
    validate(plain, world_size=len(args.devices), offline=True, check_data=False)
    outer = composer.base("none", "ddp", outer=True)
    if is_outer(outer.outer):  # the user's outer loop, checked as a DDP run would check it
        validate(outer, world_size=len(args.devices), offline=True, check_data=False)
        args = dataclasses.replace(args, sync_every=args.sync_every or SYNC_EVERY)
    elif args.sync_every is not None:
        raise ConfigError("sync_every", ",".join(map(str, args.sync_every)), "needs outer=diloco: the H it searches")
    else:
        args = dataclasses.replace(args, sync_every=())
    if args.out is not None:
        check_writable("out", args.out)
    return args, composer, plain


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
    granularities = args.granularities or (("neuron",) if extends(plain) else ("neuron", "block"))
    space = structures(
        args.devices,
        min_coverage=args.min_coverage,
        granularities=granularities,
        every=args.every,
        precisions=args.precisions,
        checkpointing=args.checkpointing,
        sync_every=args.sync_every,
    )
    print(header(args, plain, len(space)), flush=True)
    start = time.perf_counter()
    traces = TraceCache(args.cache)
    outcomes = search(
        space,
        compose=composer,
        devices=args.devices,
        cluster=args.cluster,
        workers=args.workers,
        progress=progress_line,
        traces=traces,
    )
    seconds = time.perf_counter() - start
    facts = run_facts(args, plain)
    rows = [row(o, run=facts, cluster_nodes=args.nodes) for o in outcomes]
    searched = (traces.made, traces.read)  # the verification's traces are counted apart
    best = verified(rows, {o.structure.label: o.structure for o in outcomes}, composer, args, traces=traces)
    made = sum(o.traces[0] for o in outcomes) + traces.made - searched[0]
    read = sum(o.traces[1] for o in outcomes) + traces.read - searched[1]
    print(summary(rows, best, seconds=seconds, workers=args.workers), flush=True)
    print(f"traces: {made} made, {read} read from {args.cache if args.cache else 'no cache (cache=off)'}", flush=True)
    if best:
        print(format_rows(best, unit=facts["unit"], top=args.top), flush=True)
    if args.out is not None:
        save(args, rows, best, facts, seconds=seconds, title=header(args, plain, len(space)))
    if not best:
        print(f"error: {nothing_fits(args, rows)}", file=sys.stderr)
        return 2
    return 0


VERIFIED = 3  # tries at a top row that a whole trace confirms
CLOSE = 0.03  # the headroom under which a top row from a line is traced whole (the line's promise)


def verified(
    rows: list[dict], structures: dict, composer: Composer, args: PlanArgs, *, traces: TraceCache | None = None
) -> list[dict]:
    """The ranking, its top row's peaks from whole traces (every layer) when they came from a
    line and leave less than CLOSE of its GPU free: the line is within CLOSE of the whole trace
    (docs/plan.md), so only a row that close to full could be wrong about fitting. A top row
    that then does not fit leaves the top, up to VERIFIED times."""
    for _ in range(VERIFIED):
        best = ranked(rows, objective=args.objective)
        if not best or best[0]["method"].startswith("traced") or best[0]["headroom"] >= CLOSE:
            return best
        top = best[0]
        checked = verify(top, composer(structures[top["run"]]), devices=args.devices, trace=traces or TraceCache(None))
        rows[rows.index(top)] = checked
        line = top["peaks_bytes"][checked["busiest_rank"]] / GIB
        print(
            f"top row traced whole: {checked['run']}, peak {checked['peak_gib']:.3g} GiB (the line's "
            f"{line:.3g}){'' if checked['fits'] else ': it does not fit, next'}",
            flush=True,
        )
    return ranked(rows, objective=args.objective)


def summary(rows: list[dict], best: list[dict], *, seconds: float, workers: int) -> str:
    refused = sum("refused" in r for r in rows)
    missing = len(rows) - len(best) - refused
    probes = sum(r.get("probes", 0) for r in rows)
    lines = [
        f"searched {len(rows)} structures in {seconds:.0f} s ({workers} processes, {probes} micro-batches "
        f"traced): {len(best)} fit, {missing} do not, {refused} refused by the entrypoint's checks"
    ]
    miss = nearest_miss(rows)
    if miss is not None:
        gib = miss["devices_gib"][miss["busiest_rank"]]
        lines.append(
            f"nearest miss: {miss['run']}, {miss['peak_gib']:.2f} GiB on rank {miss['busiest_rank']}'s "
            f"{gib:g} GiB at micro-batch 1 ({-miss['headroom']:.1%} over)"
        )
    lines.append(f"caveats cite claims by number: {sources()}")
    return "\n".join(lines)


def save(args: PlanArgs, rows: list[dict], best: list[dict], facts: dict, *, seconds: float, title: str) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "devices_gib": args.devices,
        "cluster": None if args.cluster is None else args.cluster.name,
        "nodes": args.nodes,
        "objective": args.objective,
        "run": facts,
        "search_s": round(seconds, 1),
        "ranked": [r["run"] for r in best],
        "rows": rows,
    }
    write_json(args.out / "plan.json", payload)
    plot(rows, args.out / "pareto.png", title=title)
    print(f"wrote {args.out / 'plan.json'} and {args.out / 'pareto.png'}", flush=True)


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
