"""What `sdp.plan` shows of a search: ranked rows, their caveats, the misses, the JSON and the plot.

A row's caveat is what our replica reports support about its kind of run, with the claim it
comes from; nothing is said where they say nothing (DDP and FSDP train the same model; uneven
capacities have no replica table). Every claim cited comes from the converged report
(claims.md: tuned rates, 3 to 5 seeds): 4b and 5 from both tables, 1 from the language table
(its flop_matched rows), 4a from the vision table (its C = 0.25 rows).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from sdp.outer.algorithms import algorithm_of
from sdp.planning.fit import GIB
from sdp.planning.rows import Row, RunFacts
from sdp.planning.search import Outcome
from sdp.planning.space import Structure, command
from sdp.planning.step_time import STEP_TERMS, step_terms
from sdp.subnet.modes import MODES, mode_of

CLAIMS = "results/cpu_replica/claims.md"
LOWCOMM = "docs/lowcomm.md"  # the low-communication comparison
MIB = 2**20
# The claims a caveat cites, by number: the report each comes from and its heading there.
CITED = {
    "1": (CLAIMS, "Claim 1: Under FLOP-matching, SDP maintains or improves quality"),
    "4a": (CLAIMS, "Claim 4a: Quality degrades below C ≈ 0.3."),
    "4b": (CLAIMS, "Claim 4b: Quality stays near DDP for C ≳ 0.3."),
    "5": (CLAIMS, "Claim 5: Backward masking (unbiased gradients) tracks DDP more closely"),
}


def sources() -> str:
    """The line that says which report each cited claim number comes from."""
    by_report: dict[str, list[str]] = {}
    for number, (report, _) in CITED.items():
        by_report.setdefault(report, []).append(number)
    return "; ".join(f"{', '.join(numbers)} from {report}" for report, numbers in by_report.items())


OBJECTIVES = ("speed", "memory", "time_to_target")


def caveat(s: Structure, *, protocol: str) -> str:
    """The replica reports' word on a structure's quality (claim numbers of CITED), and its outer
    algorithm's (its `caveat`, from the low-communication comparison, LOWCOMM)."""
    outer = "" if s.sync_every is None else f"{algorithm_of(s.outer).caveat} ({LOWCOMM})"
    if s.masking == "none":
        return outer
    coverage = s.coverage if s.capacity is None else sum(s.capacity) / len(s.capacity)
    notes = ["C < 0.3 lost quality (4a)"] if coverage < 0.3 else []
    notes.append(mode_of(s.masking).caveat(flop_matched=protocol == "flop_matched"))
    return "; ".join([*notes, outer] if outer else notes)


def row(outcome: Outcome, *, run: RunFacts, cluster_nodes: int) -> Row:
    """One structure's row: what it is, whether and how it fits, its step, its command."""
    s, found = outcome.structure, outcome.found
    if found is None:
        return Row(s, round(outcome.seconds, 2), refused=outcome.reason)
    ests = found.estimates
    busiest = found.busiest
    memory = ests[busiest].memory
    out = Row(
        s,
        round(outcome.seconds, 2),
        fits=found.fits,
        micro_batch=found.micro,
        accum=found.accum,
        peaks_bytes=found.peaks,
        devices_gib=found.gib,
        breakdown_gib={k: round(v / GIB, 3) for k, v in memory["peak_breakdown"].items()},
        comm_groups=memory["comm_groups"],
        method=ests[busiest].method,
        comm_bytes_per_step=ests[busiest].comm_bytes_per_step,
        outer_sync=_outer_sync(ests[busiest]),
        probes=found.probes,
        caveat=caveat(s, protocol=run.protocol),
    )
    if found.fits:
        out.command = command(run.overrides, s, nproc=run.world, accum=found.accum, nnodes=cluster_nodes)
        if found.step is not None:
            out.step_s = found.step["step_overlapped_s"]
            out.exposed_comm_s = found.step["exposed_overlapped_s"]
            out.per_s = run.per_step / found.step["step_overlapped_s"]
            out.step_terms = {k: found.step[k] for k in STEP_TERMS}
    return out


def _outer_sync(est) -> dict | None:
    """A window's exchange of an outer loop on the estimate's rank: its collectives' payload (the
    outer_sync kind's bytes; a sync's weight refresh apart) and what they move on the wire."""
    if est.outer is None:
        return None
    return {"bytes": est.outer["bytes_per_sync"].get("outer_sync", 0), "wire_bytes": est.outer["wire_bytes_per_sync"]}


def ranked(rows: list[Row], *, objective: str, by_target: Callable[[list[Row]], list[Row]] | None = None) -> list[Row]:
    """The rows that fit, best first: the fastest step (speed), or the smallest share of its
    GPU on the busiest rank (memory), ties broken by the other, then by fewer local steps. For
    speed, local steps must pay for themselves (`_local_steps_pay`). For time_to_target,
    `by_target` ranks them (`sdp.planning.quality.to_target` with the pilot)."""
    if objective == "time_to_target":
        return by_target(rows)
    fitting = [r for r in rows if r.fits]
    if objective == "speed":
        return _local_steps_pay(sorted(fitting, key=lambda r: (_step(r), 1 - r.headroom)))
    return sorted(fitting, key=lambda r: (1 - r.headroom, _step(r), r.sync_every))


LOCAL_STEPS_GAIN = 0.10  # the share of the step an outer loop's longer H must save to rank first


def _step(r: Row) -> float:
    """The row's step, infinite without a cluster (memory only)."""
    return float("inf") if r.step_s is None else r.step_s


def _local_steps_pay(by_step: list[Row]) -> list[Row]:
    """Rows sorted by step, re-ranked so that more local steps come first only where they make
    the step LOCAL_STEPS_GAIN faster: each next row is, of those within that share of the fastest
    row left, the one with the fewest local steps (a plain run first), then the fastest. An
    outer loop costs quality (docs/lowcomm.md), so on fast links, where averaging every step is
    nearly free, the usual row stays on top; on slow links the low-communication one takes it."""
    left, out = list(by_step), []
    while left:
        bound = _step(left[0]) * (1 + LOCAL_STEPS_GAIN)
        near = [r for r in left if _step(r) <= bound]
        pick = min(near, key=lambda r: r.sync_every)  # min keeps the first (fastest) of equal local steps
        out.append(pick)
        left.remove(pick)
    return out


def nearest_miss(rows: list[Row]) -> Row | None:
    """The traced row that does not fit whose busiest rank is over by the smallest share."""
    misses = [r for r in rows if not r.fits and r.traced]
    return max(misses, key=lambda r: r.headroom) if misses else None


def _peaks(r: Row) -> str:
    gib = {rank: round(p / GIB, 3) for rank, p in r.peaks_bytes.items()}
    if len(gib) == 1:
        (rank, peak), device = next(iter(gib.items())), r.devices_gib[r.busiest_rank]
        return f"{peak:.3g} / {device:g} (r{rank})"
    return ", ".join(f"r{k} {v:.3g}/{r.devices_gib[k]:g}" for k, v in gib.items())


def format_rows(best: list[Row], *, unit: str, top: int) -> str:
    """The ranked rows, each followed by its command."""
    lines = [
        f"  {'#':>3}  {'run':<50} {'micro x acc':>11}  {'peak GiB (rank)':<24} {'free':>5}  "
        f"{'step s':>8}  {unit + '/s':>12}  {'sent MiB/step':>13}  caveat (claims)"
    ]
    for i, r in enumerate(best[:top], 1):
        step = f"{'-':>8}" if r.step_s is None else f"{r.step_s:8.4f}"
        rate = f"{'-':>12}" if r.step_s is None else f"{r.per_s:12,.0f}"
        lines.append(
            f"  {i:>3}  {r.run:<50} {r.micro_batch:>5} x {r.accum:<3}  {_peaks(r):<24} "
            f"{r.headroom:5.0%}  {step}  {rate}  {r.comm_bytes_per_step / MIB:13,.1f}  {r.caveat}"
        )
        if r.to_target is not None:
            lines.append(f"       to target: {r.to_target}")
        if r.step_terms is not None:
            lines.append(f"       step: {step_terms(r.step_terms)}")
        lines.append(f"       $ {r.command}")
    if len(best) > top:
        lines.append(f"  ... {len(best) - top} more rows that fit (top=all shows them; out=DIR keeps them all)")
    return "\n".join(lines)


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n")


def pareto(rows: list[Row]) -> list[Row]:
    """The fitting rows no other beats on both the busiest share of its GPU and the step."""
    pts = sorted((r for r in rows if r.fits and r.step_s is not None), key=lambda r: (1 - r.headroom, r.step_s))
    front, best = [], float("inf")
    for r in pts:
        if r.step_s < best:
            front.append(r)
            best = r.step_s
    return front


def plot(rows: list[Row], path: Path, *, title: str) -> None:
    """Memory (the busiest rank's share of its GPU) against step time: every traced row, the
    Pareto front joined and labelled."""
    import matplotlib  # noqa: PLC0415  (lazy: only out=DIR draws, and pyplot costs seconds)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(9, 6))
    colors = iter(["tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:gray"])
    captions = {"none": ("DDP / FSDP", "tab:blue")} | {n: (m.caption, next(colors)) for n, m in MODES.items()}
    for mode, (label, color) in captions.items():
        pts = [r for r in rows if r.fits and r.step_s is not None and r.structure.masking == mode]
        ax.scatter([100 * (1 - r.headroom) for r in pts], [r.step_s for r in pts], c=color, s=18, label=label)
    front = pareto(rows)
    ax.plot([100 * (1 - r.headroom) for r in front], [r.step_s for r in front], "k--", lw=1, label="Pareto front")
    for r in front:
        ax.annotate(r.run, (100 * (1 - r.headroom), r.step_s), fontsize=7, xytext=(4, 2), textcoords="offset points")
    ax.axvline(100, color="red", lw=0.8)
    ax.set_xlabel("peak of the busiest rank, % of its GPU")
    ax.set_ylabel("predicted step time, s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
