"""The paper's claims checked against collected tables: `python -m sdp.collect RUNS --claims`.

Every quality claim is a set of comparisons between two rows of one table (a model on a
dataset). A comparison's difference d is oriented so that d > 0 is what the claim says
(the first row better: higher eval accuracy, or lower eval loss), and its standard error is
sqrt(s_a^2 / n_a + s_b^2 / n_b) over the rows' seeds. The rule, the same for every claim:

- *holds* when d > Z * SE;
- *does not hold* when d < -Z * SE;
- *not distinguishable at this scale* otherwise;
- *too few runs* when either row has fewer than MIN_RUNS completed runs;
- *not converged*, never a verdict, when a run of either row (or of DDP, for a comparison
  against DDP's quality) did not pass its convergence gate (`sdp.metrics.convergence`).

The memory claims are measurements, exact to the byte, not estimates from seeds: each is
checked against the reduction a source reports (the collected run dirs, the estimator's
memory table, the CUDA measurements), with the rule stated next to it.

This module only reads rows (`sdp.collect.build_rows`) and result files: it knows nothing
of how the runs were made, so it reads a user's full-scale runs as it reads the CPU replica.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

Z = 2.0
MIN_RUNS = 3
HOLDS, FAILS, UNCLEAR, FEW = "holds", "does not hold", "not distinguishable at this scale", "too few runs"
NOT_CONVERGED = "not converged"
GAP = 0.3  # claim 4's coverage threshold ("C ≳ 0.3")


@dataclass(frozen=True)
class Measure:
    """A row's quality over its seeds, oriented so that larger is better."""

    mean: float
    std: float
    n: int

    @property
    def se(self) -> float:
        return self.std / math.sqrt(self.n) if self.n > 1 else math.inf


@dataclass(frozen=True)
class Comparison:
    table: str
    first: str
    second: str
    d: float  # > 0: the claim's direction
    se: float
    runs: tuple[int, int]
    converged: bool = True  # every run of the rows compared passed its convergence gate

    @property
    def verdict(self) -> str:
        if not self.converged:
            return NOT_CONVERGED
        if min(self.runs) < MIN_RUNS:
            return FEW
        if self.d > Z * self.se:
            return HOLDS
        if self.d < -Z * self.se:
            return FAILS
        return UNCLEAR


@dataclass(frozen=True)
class Claim:
    number: str
    text: str
    reads: str  # what the comparisons are, in words
    comparisons: list[Comparison]
    note: str = ""

    @property
    def verdict(self) -> str:
        """One verdict when every comparison agrees; otherwise the count of each."""
        verdicts = [c.verdict for c in self.comparisons]
        if not verdicts:
            return "no rows to compare"
        if len(set(verdicts)) == 1:
            return verdicts[0]
        order = (HOLDS, FAILS, UNCLEAR, FEW, NOT_CONVERGED)
        return ", ".join(f"{v} in {verdicts.count(v)}" for v in order if v in verdicts)


def measure(row: dict, kind: str) -> Measure | None:
    """Eval accuracy in points (image tables) or minus the eval loss (text tables)."""
    if kind == "image":
        mean, std, scale = row.get("eval_acc"), row.get("eval_acc_std"), 100.0
    else:
        mean, std, scale = row.get("eval_loss"), row.get("eval_loss_std"), -1.0
    if mean is None:
        return None
    return Measure(scale * mean, abs(scale) * (std or 0.0), row["runs"])


def name(row: dict) -> str:
    if row["variant"].split(" ")[0] in ("DDP", "FSDP"):  # the dense control too: "DDP (inner width 0.5)"
        return row["variant"]
    text = f"{row['variant']} C={row['coverage']:g}"
    return text if row["protocol"] == "same_iteration" else f"{text} ({row['protocol']})"


def _better(table: str, a: dict, b: dict, kind: str) -> Comparison | None:
    """Row a better than row b."""
    ma, mb = measure(a, kind), measure(b, kind)
    if ma is None or mb is None:
        return None
    converged = _converged(a, b)
    return Comparison(table, name(a), name(b), ma.mean - mb.mean, math.hypot(ma.se, mb.se), (ma.n, mb.n), converged)


def _closer(table: str, a: dict, b: dict, ddp: dict, kind: str) -> Comparison | None:
    """Row a nearer DDP's quality than row b: d = |b - DDP| - |a - DDP|. When a and b lie on one
    side of DDP, DDP's noise cancels from d; otherwise it enters twice."""
    ma, mb, md = measure(a, kind), measure(b, kind), measure(ddp, kind)
    if ma is None or mb is None or md is None:
        return None
    ga, gb = ma.mean - md.mean, mb.mean - md.mean
    se = math.hypot(ma.se, mb.se) if ga * gb >= 0 else math.sqrt(ma.se**2 + mb.se**2 + 4 * md.se**2)
    runs = (min(ma.n, md.n), min(mb.n, md.n))
    return Comparison(table, name(a), name(b), abs(gb) - abs(ga), se, runs, _converged(a, b, ddp))


def _converged(*rows: dict) -> bool:
    """Whether every run of these rows passed its convergence gate (a row without the entry: no)."""
    return all(r.get("converged") is True for r in rows)


def _sdp(row: dict) -> bool:
    """An SDP row of the model as configured, nothing stacked on it."""
    plain = " x " not in row["variant"] and "+" not in row["variant"] and row.get("inner_width", 1.0) == 1
    return plain and row["variant"].split(" ")[0] in ("N-SDP", "B-SDP")


def _dense_control(rows: list[dict], coverage: float) -> dict | None:
    """DDP over the dense model with N-SDP's subnetwork at `coverage` (model.inner_width = C)."""
    return next((r for r in rows if r["variant"] == f"DDP (inner width {coverage:g})"), None)


def _mode(row: dict) -> str:
    return row["variant"].split(" ")[1]


def _gran(row: dict) -> str:
    return row["variant"].split(" ")[0]


def quality_claims(tables: dict[str, dict]) -> list[Claim]:
    """Claims 1-5 of the paper and the dense control (6), each as its comparisons in every table that has the rows."""
    found: dict[str, list[Comparison]] = {k: [] for k in CLAIMS}

    def add(key: str, comparison: Comparison | None) -> None:
        if comparison is not None:
            found[key].append(comparison)

    for table, info in sorted(tables.items()):
        rows, kind = info["rows"], info["kind"]
        ddp = next((r for r in rows if r["variant"] == "DDP"), None)
        sdp = [r for r in rows if _sdp(r)]
        matched = [r for r in sdp if r["protocol"] == "flop_matched"]
        same = [r for r in sdp if r["protocol"] == "same_iteration"]
        if ddp is not None:
            for r in matched:
                add("1", _better(table, r, ddp, kind))
                if kind == "image" and _mode(r) == "forward":
                    add("3", _better(table, r, ddp, kind))
            for r in same:
                if r["coverage"] >= GAP:
                    add("4b", _better(table, r, ddp, kind))
                twin = _find(same, f"{_gran(r)} forward", r["coverage"]) if _mode(r) == "backward" else None
                if twin is not None:
                    add("5", _closer(table, r, twin, ddp, kind))
        for r in same:
            dense = _dense_control(rows, r["coverage"]) if _gran(r) == "N-SDP" else None
            if dense is not None:
                add("6", _better(table, r, dense, kind))
        for r in sdp:
            twin = _find(sdp, f"N-SDP {_mode(r)}", r["coverage"], r["protocol"]) if _gran(r) == "B-SDP" else None
            if twin is not None:
                add("2", _better(table, r, twin, kind))
        for variant in sorted({r["variant"] for r in same}):
            high = [r for r in same if r["variant"] == variant and r["coverage"] >= GAP]
            low = [r for r in same if r["variant"] == variant and r["coverage"] < GAP]
            if high and low:
                add("4a", _better(table, min(high, key=_c), max(low, key=_c), kind))
    return [Claim(n, text, reads, found[n], *note) for n, (text, reads, *note) in CLAIMS.items()]


def _c(row: dict) -> float:
    return row["coverage"]


def _find(rows: list[dict], variant: str, coverage: float, protocol: str = "same_iteration") -> dict | None:
    return next(
        (r for r in rows if r["variant"] == variant and r["coverage"] == coverage and r["protocol"] == protocol), None
    )


MAINTAINS = (
    "The claim allows equal quality: *holds* is an improvement, *not distinguishable* is what "
    "'maintains' predicts (though it is not proof of equality), and only *does not hold* contradicts it."
)
CLAIMS = {
    "1": (
        "Under FLOP-matching, SDP maintains or improves quality (v5).",
        "every SDP row under flop_matched against DDP",
        MAINTAINS,
    ),
    "2": ("B-SDP beats N-SDP (v1, and a reviewer).", "B-SDP against N-SDP at the same masking mode, C and protocol"),
    "3": (
        "Forward masking under FLOP-matching can beat DDP in vision: a regularisation effect.",
        "forward SDP rows under flop_matched against DDP, image tables only",
    ),
    "4a": (
        "Quality degrades below C ≈ 0.3.",
        "each SDP variant at its lowest C >= 0.3 against the same variant at its highest C < 0.3 (same_iteration)",
    ),
    "4b": (
        "Quality stays near DDP for C ≳ 0.3.",
        "every SDP row with C >= 0.3 under same_iteration against DDP",
        MAINTAINS,
    ),
    "5": (
        "Backward masking (unbiased gradients) tracks DDP more closely than forward masking at the same steps.",
        "backward against forward, same granularity and C (same_iteration): d = |forward - DDP| - |backward - DDP|",
    ),
    "6": (
        "N-SDP beats a dense model of its subnetwork's size trained with DDP (a control, not a claim of the paper).",
        "every N-SDP row at C (same_iteration) against DDP at model.inner_width = C, the dense model with the "
        "tensors of forward masking's subnetwork, on the same data and steps",
        "FedRolex (arXiv 2212.01548) found that training random slices of a model can lose to training the "
        "smallest dense model; a subnetwork method earns its complexity only where this holds.",
    ),
}


@dataclass(frozen=True)
class MemoryPoint:
    """One configuration's per-device peak against DDP's, from one source."""

    source: str
    model: str
    variant: str  # the paper's label, stacked methods included
    reduction: float  # 1 - peak / DDP's peak

    @property
    def sdp(self) -> bool:
        return "N-SDP" in self.variant or "B-SDP" in self.variant

    @property
    def stacked(self) -> bool:
        return " x FSDP" in self.variant or "+ AC" in self.variant

    @property
    def fully_stacked(self) -> bool:
        return "FSDP" in self.variant and "+ AC" in self.variant


def points_from_tables(tables: dict[str, dict], source: str) -> list[MemoryPoint]:
    """The collected tables' live-tensor peaks against each table's DDP row."""
    return [
        MemoryPoint(source, table, name(r), -r["peak_gib_vs_ddp"])
        for table, info in sorted(tables.items())
        for r in info["rows"]
        if r.get("peak_gib_vs_ddp") is not None and r["variant"] != "DDP"
    ]


def points_from_memory_table(path: Path) -> list[MemoryPoint]:
    """The estimator's table (`make memory-table`, its .csv): peak_vs_ddp as '-12.3%'."""
    with Path(path).open(newline="") as f:
        rows = list(csv.DictReader(f))
    return [
        MemoryPoint(
            str(path),
            r["model"],
            f"{r['variant']} C={float(r['coverage']):g}",
            -float(r["peak_vs_ddp"].rstrip("%")) / 100,
        )
        for r in rows
        if r["variant"] != "DDP" and r["peak_vs_ddp"]
    ]


def points_from_cuda(paths: list[Path]) -> list[MemoryPoint]:
    """CUDA's max allocated per rank (scripts/cuda_memory_check.py's .json files), against the
    DDP row of the same model in any of the files."""
    rows = [(str(p), r) for p in paths for r in json.loads(Path(p).read_text())["rows"]]
    ddp = {r["model"]: r["measured"]["cuda_max_allocated"] for _, r in rows if r["variant"] == "DDP"}
    return [
        MemoryPoint(path, r["model"], r["variant"], 1 - r["measured"]["cuda_max_allocated"] / ddp[r["model"]])
        for path, r in rows
        if r["variant"] != "DDP" and r["model"] in ddp and r["measured"].get("cuda_max_allocated")
    ]


LOW, HIGH, STACKED = 0.28, 0.60, 0.85  # v5: -28...60% alone; -85% with FSDP and activation checkpointing


def memory_lines(points: list[MemoryPoint]) -> list[str]:
    """Claims M1 and M2 per source and model, as markdown table rows."""
    lines = []
    for source, model in sorted({(p.source, p.model) for p in points}):
        here = [p for p in points if (p.source, p.model) == (source, model)]
        alone = [p for p in here if p.sdp and not p.stacked]
        if alone:
            best = max(alone, key=lambda p: p.reduction)
            verdict = HOLDS if best.reduction >= LOW else FAILS
            span = f"{_pc(min(p.reduction for p in alone))} to {_pc(best.reduction)} (best: {best.variant})"
            lines.append(f"| M1 | {source} | {model} | {span} | {verdict} |")
        stack = [p for p in here if p.sdp and p.fully_stacked]
        if stack:
            best = max(stack, key=lambda p: p.reduction)
            plain = [p for p in here if not p.sdp and p.fully_stacked]
            without = max(plain, key=lambda p: p.reduction) if plain else None
            extra = f"; without SDP, {without.variant}: {_pc(without.reduction)}" if without else ""
            verdict = HOLDS if best.reduction >= STACKED else FAILS
            lines.append(f"| M2 | {source} | {model} | {_pc(best.reduction)} ({best.variant}){extra} | {verdict} |")
    return lines


def _pc(reduction: float) -> str:
    return f"-{reduction * 100:.1f}%" if reduction >= 0 else f"+{-reduction * 100:.1f}%"


def _value(d: float, kind: str) -> str:
    return f"{d:+.2f} points" if kind == "image" else f"{d:+.4f} loss"


def claims_markdown(tables: dict[str, dict], memory: list[MemoryPoint], *, command: str) -> str:
    """claims.md: the rule, then every claim with its comparisons and verdict, then memory."""
    kinds = {table: info["kind"] for table, info in tables.items()}
    lines = [
        "# The paper's claims, checked",
        "",
        f"Generated by `{command}` from run dirs. Quality is eval accuracy (image tables, in points) or eval "
        "loss (text tables); every difference d is oriented so that d > 0 is the claim's direction, with its "
        f"standard error SE over seeds (sqrt(s1^2/n1 + s2^2/n2)). Rule: **{HOLDS}** when d > {Z:g} SE, "
        f"**{FAILS}** when d < -{Z:g} SE, **{UNCLEAR}** in between, **{FEW}** when a row has fewer than "
        f"{MIN_RUNS} completed runs, and **{NOT_CONVERGED}**, never a verdict, when a run of a row compared (or of "
        "DDP, where the claim reads DDP's quality) did not pass its convergence gate (its smoothed eval metric "
        "moved by trainer.plateau_threshold or more over the last 20% of its steps). A claim's verdict is its "
        "comparisons' verdict when they agree, else the count of each.",
        "",
    ]
    for claim in quality_claims(tables):
        lines += [
            f"## Claim {claim.number}: {claim.text}",
            "",
            f"Compares {claim.reads}. **Verdict: {claim.verdict}.**",
        ]
        if claim.note:
            lines += ["", claim.note]
        if claim.comparisons:
            lines += [
                "",
                "| table | row | against | d | SE | d / SE | runs | verdict |",
                "|---|---|---|---|---|---|---|---|",
            ]
        for c in claim.comparisons:
            ratio = f"{c.d / c.se:+.1f}" if c.se not in (0, math.inf) else "—"
            se = _value(c.se, kinds[c.table]).lstrip("+") if math.isfinite(c.se) else "—"
            lines.append(
                f"| {c.table} | {c.first} | {c.second} | {_value(c.d, kinds[c.table])} | {se} | {ratio} "
                f"| {c.runs[0]}, {c.runs[1]} | {c.verdict} |"
            )
        lines.append("")
    lines += [
        "## Memory: M1, SDP alone cuts per-device memory by 28-60% (v5); M2, stacked with FSDP and activation "
        "checkpointing, by up to 85%",
        "",
        "Per-device peak against DDP's, measured, so no seeds: M1 *holds* for a source when its best SDP row "
        f"(without FSDP or AC) saves at least {LOW:.0%}, M2 when its best SDP x FSDP + AC row saves at least "
        f"{STACKED:.0%}; the same stack without SDP is shown beside it, since most of M2's saving is FSDP's and AC's.",
        "",
        "| claim | source | model | reduction of the peak | verdict |",
        "|---|---|---|---|---|",
        *memory_lines(memory),
        "",
    ]
    return "\n".join(lines)
