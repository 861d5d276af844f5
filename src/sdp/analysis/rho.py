"""The spectral gap against convergence, from run dirs (`scripts/rho_convergence.py`).

The paper's convergence bound for backward masking goes through ρ, the spectral gap of the
masking operator (`sdp.subnet.mask.mask_stats`: 0 when the workers split into groups that
never average together, 1 when every worker holds everything). These functions put each SDP
run's ρ beside what it reached:

- its final eval loss;
- the steps it took to reach DDP's eval loss at half of DDP's budget (DDP's mean over its
  runs at the last evaluation at or before half its steps): the first evaluation at or
  below it, or none within the run.

and compare each construction's final eval loss with that of the blocked mask (ρ = 0) of the
same variant, by the rule of claims.md (`sdp.analysis.claims.Comparison`: mixing helps when the
blocked mask's loss is higher by more than 2 standard errors over the seeds).

Like `sdp.collect`, they read only summary.json and metrics.jsonl.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from sdp.analysis.claims import Comparison, Measure
from sdp.rundir import Summary, evaluations, variant_label

POOR = "blocked"  # the construction every other one is compared with (ρ = 0)


@dataclass(frozen=True)
class RhoPoint:
    variant: str  # e.g. N-SDP backward
    construction: str
    seed: int
    rho: float
    final_eval_loss: float
    steps_to_target: int | None  # None: DDP's half-budget loss not reached


def ddp_target(ddp: list[tuple[Path, Summary]]) -> tuple[int, float]:
    """DDP's mean eval loss at the last evaluation at or before half its steps, and that step."""
    half = min(s.steps for _, s in ddp) / 2
    at = [max(((step, loss) for step, loss in evaluations(d) if step <= half), default=None) for d, _ in ddp]
    if not at or any(a is None for a in at) or len({a[0] for a in at}) != 1:
        raise SystemExit(f"error: the DDP runs need one evaluation at the same step at or before step {half:g}")
    return at[0][0], statistics.fmean(loss for _, loss in at)


def rho_points(runs: list[tuple[Path, Summary]], target: float) -> list[RhoPoint]:
    """One point per completed SDP run."""
    points = []
    for run_dir, s in runs:
        if s.status != "completed" or s.masking not in ("backward", "forward"):
            continue
        curve = evaluations(run_dir)
        reached = next((step for step, loss in curve if loss <= target), None)
        points.append(
            RhoPoint(
                variant=variant_label(s.masking, granularity=s.strategy.get("granularity")),
                construction=s.strategy.get("construction", "?"),
                seed=s.seed,
                rho=s.strategy["mask"]["spectral_gap"],
                final_eval_loss=s.eval_loss,
                steps_to_target=reached,
            )
        )
    return sorted(points, key=lambda p: (p.variant, -p.rho, p.construction, p.seed))


def _mean_std(values: list[float]) -> str:
    if not values:
        return "—"
    mean = statistics.fmean(values)
    return f"{mean:.4f} ± {statistics.stdev(values):.4f}" if len(values) > 1 else f"{mean:.4f}"


def _loss(points: list[RhoPoint]) -> Measure:
    losses = [p.final_eval_loss for p in points]
    return Measure(-statistics.fmean(losses), statistics.stdev(losses) if len(losses) > 1 else 0.0, len(losses))


def mixing_comparisons(points: list[RhoPoint]) -> list[Comparison]:
    """Per variant, each construction against the blocked mask: d = blocked's mean final eval
    loss minus the construction's (d > 0: the better-mixing mask ends lower)."""
    out = []
    for variant in sorted({p.variant for p in points}):
        mine = [p for p in points if p.variant == variant]
        poor = [p for p in mine if p.construction == POOR]
        if not poor:
            continue
        for construction in sorted({p.construction for p in mine} - {POOR}):
            a, b = _loss([p for p in mine if p.construction == construction]), _loss(poor)
            first, second = f"{variant} {construction}", f"{variant} {POOR}"
            out.append(Comparison("rho", first, second, a.mean - b.mean, math.hypot(a.se, b.se), (a.n, b.n)))
    return out


def _mixing_lines(points: list[RhoPoint]) -> list[str]:
    comparisons = mixing_comparisons(points)
    if not comparisons:
        return []
    lines = [
        "",
        f"Does mixing help? Each construction's final eval loss against the {POOR} mask's (ρ = 0) of the same "
        "variant: d = blocked's mean minus the construction's (d > 0: the better-mixing mask ends lower), "
        "SE over the seeds, and the rule of claims.md (holds when d > 2 SE, does not hold when d < -2 SE).",
        "",
        "| comparison | d (eval loss) | SE | runs | verdict |",
        "|---|---|---|---|---|",
    ]
    for c in comparisons:
        lines.append(f"| {c.first} vs {c.second} | {c.d:+.4f} | {c.se:.4f} | {c.runs[0]}, {c.runs[1]} | {c.verdict} |")
    return lines


def rho_markdown(points: list[RhoPoint], *, target: tuple[int, float], ddp_final: list[float], command: str) -> str:
    """The experiment's table: one row per (variant, construction), each construction against the
    blocked mask (`mixing_comparisons`), then every run."""
    step, loss = target
    lines = [
        "# Spectral gap ρ against convergence",
        "",
        f"Generated by `{command}` from run dirs. K = 4 workers, C = 0.5, the same data and seeds for every "
        f"row. *target*: DDP's eval loss at step {step} (half its budget), {loss:.4f} (mean of its "
        f"{len(ddp_final)} runs); *steps to target*: the first evaluation at or below it (— when not "
        f"reached). DDP's final eval loss: {_mean_std(ddp_final)}.",
        "",
        "| variant | construction | ρ | runs | final eval loss | steps to target (per run) |",
        "|---|---|---|---|---|---|",
    ]
    keys = sorted({(p.variant, p.construction) for p in points}, key=lambda k: (k[0], k[1]))
    for variant, construction in keys:
        group = [p for p in points if (p.variant, p.construction) == (variant, construction)]
        rhos = sorted({p.rho for p in group})
        rho = f"{rhos[0]:.3f}" if len(rhos) == 1 else f"{min(rhos):.3f} to {max(rhos):.3f}"
        reached = ", ".join("—" if p.steps_to_target is None else str(p.steps_to_target) for p in group)
        lines.append(
            f"| {variant} | {construction} | {rho} | {len(group)} | {_mean_std([p.final_eval_loss for p in group])} "
            f"| {reached} |"
        )
    lines += _mixing_lines(points)
    lines += [
        "",
        "| variant | construction | seed | ρ | final eval loss | steps to target |",
        "|---|---|---|---|---|---|",
    ]
    for p in points:
        reached = "—" if p.steps_to_target is None else str(p.steps_to_target)
        lines.append(
            f"| {p.variant} | {p.construction} | {p.seed} | {p.rho:.3f} | {p.final_eval_loss:.4f} | {reached} |"
        )
    return "\n".join(lines) + "\n"


def rho_plot(points: list[RhoPoint], path: Path, *, budget: int) -> Path:
    """Two panels against ρ: final eval loss, and steps to DDP's half-budget loss (runs that did
    not reach it are drawn at the budget, hollow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for i, variant in enumerate(sorted({p.variant for p in points})):
        color = f"C{i}"
        mine = [p for p in points if p.variant == variant]
        left.scatter([p.rho for p in mine], [p.final_eval_loss for p in mine], color=color, label=variant)
        hit = [p for p in mine if p.steps_to_target is not None]
        miss = [p for p in mine if p.steps_to_target is None]
        right.scatter([p.rho for p in hit], [p.steps_to_target for p in hit], color=color, label=variant)
        right.scatter([p.rho for p in miss], [budget] * len(miss), facecolors="none", edgecolors=color)
    left.set(xlabel="spectral gap ρ", ylabel="final eval loss", title="final eval loss")
    right.set(xlabel="spectral gap ρ", ylabel="steps", title="steps to DDP's loss at half its budget")
    right.axhline(budget, color="grey", ls=":", lw=1)
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
