"""A plan from start to end, as `sdp.plan` runs it: the arguments checked, the structures searched,
the top row verified, the summary, and the files written.

`prepare` refuses every bad input before any trace; `make_plan` searches `sdp.planning.space`'s
structures (`sdp.planning.search`) and ranks them (`sdp.planning.report`), with its top row traced
whole when a line's peak leaves it close to full (`verified`); `save` writes plan.json and the
Pareto plot. The command only prints what these return.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from sdp.errors import ConfigError
from sdp.outer import is_outer
from sdp.paths import check_writable
from sdp.planning.checks import CheckCache
from sdp.planning.fit import GIB
from sdp.planning.layered import extends
from sdp.planning.options import PlanArgs, parse_plan
from sdp.planning.quality import NO_PILOT, target_ranking
from sdp.planning.report import format_rows, nearest_miss, plot, ranked, row, sources, write_json
from sdp.planning.rows import Row, RunFacts
from sdp.planning.search import Composer, Outcome, search, verify
from sdp.planning.space import SYNC_EVERY, Structure, structures
from sdp.planning.traces import TraceCache
from sdp.run.config import RunConfig

VERIFIED = 3  # tries at a top row that a whole trace confirms
CLOSE = 0.03  # the headroom under which a top row from a line is traced whole (the line's promise)


@dataclass
class Plan:
    """A finished plan: every structure's row, the ranking of those that fit, what the rows
    share (`facts`), the search's seconds, and the traces made and read from the cache."""

    args: PlanArgs
    title: str
    rows: list[Row]
    best: list[Row]
    facts: RunFacts
    seconds: float
    made: int
    read: int

    def summary(self) -> str:
        return summary(self.rows, self.best, seconds=self.seconds, workers=self.args.workers)

    def traces_line(self) -> str:
        where = self.args.cache if self.args.cache else "no cache (cache=off)"
        return f"traces: {self.made} made, {self.read} read from {where}"

    def table(self) -> str:
        return format_rows(self.best, unit=self.facts.unit, top=self.args.top)


def prepare(argv: list[str]) -> tuple[PlanArgs, Composer, RunConfig]:
    """The arguments, the composer, and the run's plain config, checked: every refusal of a bad
    input, before any trace."""
    args = parse_plan(argv)
    check = CheckCache(args.cache)
    composer = Composer(args.overrides, world=len(args.devices), check=check)
    plain = composer.base("none", "ddp")
    check(plain, world_size=len(args.devices))
    outer = composer.base("none", "ddp", outer=True)
    if is_outer(outer.outer):  # the user's outer loop, checked as a DDP run would check it
        check(outer, world_size=len(args.devices))
        args = dataclasses.replace(args, sync_every=args.sync_every or SYNC_EVERY, outer=str(outer.outer.name))
    elif args.sync_every is not None:
        raise ConfigError("sync_every", ",".join(map(str, args.sync_every)), "needs outer=diloco: the H it searches")
    else:
        args = dataclasses.replace(args, sync_every=())
    if args.quality is not None:
        ranking = target_ranking(args.quality, plain, world=len(args.devices), outer=outer.outer.name)
        args = dataclasses.replace(args, ranking=ranking)
    if args.out is not None:
        check_writable("out", args.out)
    return args, composer, plain


def space_of(args: PlanArgs, plain: RunConfig) -> list[Structure]:
    """The structures searched: a model that extends layer by layer searches neurons only unless
    granularity= says otherwise."""
    granularities = args.granularities or (("neuron",) if extends(plain) else ("neuron", "block"))
    return structures(
        args.devices,
        min_coverage=args.min_coverage,
        granularities=granularities,
        every=args.every,
        precisions=args.precisions,
        checkpointing=args.checkpointing,
        sync_every=args.sync_every,
        outer=args.outer,
    )


def make_plan(
    args: PlanArgs,
    composer: Composer,
    plain: RunConfig,
    space: list[Structure],
    *,
    say: Callable[[str], None],
) -> Plan:
    """Search `space` on the devices, rank the rows, and verify the top one (`say`: the
    verification's lines, as they come)."""
    start = time.perf_counter()
    traces = TraceCache(args.cache)
    outcomes = search(
        space,
        compose=composer,
        devices=args.devices,
        cluster=args.cluster,
        workers=args.workers,
        progress=Progress(),
        traces=traces,
    )
    seconds = time.perf_counter() - start
    facts = run_facts(args, plain)
    rows = [row(o, run=facts, cluster_nodes=args.nodes) for o in outcomes]
    searched = (traces.made, traces.read)  # the workers' traces are counted in their outcomes
    best = verified(rows, composer, args, traces=traces, say=say)
    made = sum(o.traces[0] for o in outcomes) + traces.made - searched[0]
    read = sum(o.traces[1] for o in outcomes) + traces.read - searched[1]
    return Plan(args, header(args, plain, len(space)), rows, best, facts, seconds, made, read)


def verified(
    rows: list[Row],
    composer: Composer,
    args: PlanArgs,
    *,
    traces: TraceCache | None = None,
    say: Callable[[str], None] = print,
) -> list[Row]:
    """The ranking, its top row's peaks from whole traces (every layer) when they came from a
    line and leave less than CLOSE of its GPU free: the line is within CLOSE of the whole trace
    (docs/plan.md), so only a row that close to full could be wrong about fitting. A top row
    that then does not fit leaves the top, up to VERIFIED times."""
    for _ in range(VERIFIED):
        best = ranked(rows, objective=args.objective, by_target=args.ranking)
        if not best or best[0].method.startswith("traced") or best[0].headroom >= CLOSE:
            return best
        top = best[0]
        checked = verify(top, composer(top.structure), devices=args.devices, trace=traces or TraceCache(None))
        rows[rows.index(top)] = checked
        line = top.peaks_bytes[checked.busiest_rank] / GIB
        say(
            f"top row traced whole: {checked.run}, peak {checked.peak_gib:.3g} GiB (the line's "
            f"{line:.3g}){'' if checked.fits else ': it does not fit, next'}"
        )
    return ranked(rows, objective=args.objective, by_target=args.ranking)


def run_facts(args: PlanArgs, cfg: RunConfig) -> RunFacts:
    """What every row shares: the user's overrides, the world, the work of a step."""
    text = cfg.dataset.kind == "text"
    per_step = cfg.trainer.global_batch_size * (cfg.dataset.seq_len if text else 1)
    unit = "tokens" if text else "samples"
    return RunFacts(list(args.overrides), len(args.devices), cfg.trainer.protocol, unit, per_step)


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


def pilot_line(args: PlanArgs) -> str:
    """What the ranking stands on: the pilot (its target and scale), or how to give one."""
    return NO_PILOT if args.ranking is None else args.ranking.line()


class Progress:
    """The search's progress on stderr. On a terminal, one line rewritten as each structure's
    search ends: structures done, traces made, and the time left at the pace so far; elsewhere
    (a log, CI) nothing: the summary's "searched ..." line is the one line at the end."""

    def __init__(self, stream=None):
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()
        self.start, self.made = time.perf_counter(), 0

    def __call__(self, outcome: Outcome, done: int, total: int) -> None:
        self.made += outcome.traces[0]
        if not self.tty:
            return
        elapsed = time.perf_counter() - self.start
        left = elapsed / done * (total - done) if done else 0.0
        line = f"[{done}/{total}] structures searched, {self.made} traces made, about {left:.0f} s left"
        self.stream.write(f"\r\x1b[K{line}" + ("\n" if done == total else ""))
        self.stream.flush()


def summary(rows: list[Row], best: list[Row], *, seconds: float, workers: int) -> str:
    refused = sum(not r.traced for r in rows)
    missing = len(rows) - len(best) - refused
    probes = sum(r.probes for r in rows)
    lines = [
        f"searched {len(rows)} structures in {seconds:.0f} s ({workers} processes, {probes} micro-batches "
        f"traced): {len(best)} fit, {missing} do not, {refused} refused by the entrypoint's checks"
    ]
    miss = nearest_miss(rows)
    if miss is not None:
        gib = miss.devices_gib[miss.busiest_rank]
        lines.append(
            f"nearest miss: {miss.run}, {miss.peak_gib:.2f} GiB on rank {miss.busiest_rank}'s "
            f"{gib:g} GiB at micro-batch 1 ({-miss.headroom:.1%} over)"
        )
    lines.append(f"caveats cite claims by number: {sources()}")
    return "\n".join(lines)


def nothing_fits(args: PlanArgs, rows: list[Row]) -> str:
    """The one-line refusal when no row fits: the smallest peak and what would make it fit."""
    miss = nearest_miss(rows)
    if miss is None:
        first = next(r.refused for r in rows)
        return f"devices={args.devices_text!r}: nothing can be planned: every structure is refused, e.g. {first}"
    gib, b = miss.devices_gib[miss.busiest_rank], miss.breakdown_gib
    static = b["weights"] + b["grads"] + b["optimizer"] + (miss.peak_gib - b["total"])
    ways = []
    if static < gib:
        share = (gib - static) / max(b["activations"] + b["temporaries"], 1e-9)
        ways.append(f"fewer tokens per rank (about {share:.0%} of them: a shorter dataset.seq_len or image)")
    else:
        ways.append(f"more devices (weights, gradients, optimizer state and communicators alone take {static:.3g} GiB)")
    k = len(args.devices)
    searched = [r.structure.coverage for r in rows if r.structure.masking != "none"]
    if searched and 1 / k < min(c for c in searched if c) - 1e-9:  # r / K: 1 / K is the lowest K gives
        ways.append(f"a lower coverage (min_coverage={1 / k:g} coverages=all: C = 1/{k} is the lowest {k} GPUs give)")
    return (
        f"devices={args.devices_text!r}: nothing fits: the smallest peak is {miss.peak_gib:.3g} GiB on a "
        f"{gib:g} GiB GPU ({miss.run}, micro-batch 1, rank {miss.busiest_rank}); to fit, try " + ", or ".join(ways)
    )


def save(plan: Plan) -> list[str]:
    """plan.json (every row, the ranking, what they share) and pareto.png in `out=`; their paths."""
    out = plan.args.out
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "devices_gib": plan.args.devices,
        "cluster": None if plan.args.cluster is None else plan.args.cluster.name,
        "nodes": plan.args.nodes,
        "objective": plan.args.objective,
        "run": plan.facts.to_json(),
        "search_s": round(plan.seconds, 1),
        "traces": {"made": plan.made, "read": plan.read},
        "ranked": [r.run for r in plan.best],
        "rows": [r.to_json(plan.facts.unit) for r in plan.rows],
    }
    write_json(out / "plan.json", payload)
    plot(plan.rows, out / "pareto.png", title=plan.title)
    return [str(out / "plan.json"), str(out / "pareto.png")]
