"""CPU-scale replicas of the paper's tables (`make tables`): real offline data, tiny models.

    python scripts/cpu_replica.py [--runs outputs/cpu_replica] [--out results/cpu_replica]
                                  [--tables vision language] [--budgets-only] [--plan]
                                  [--grid 0.5 1 2] [--seed-counts 5 3] [--rows PATTERN ...]
                                  [OVERRIDES ...]

Each table is 4 CPU processes (K = 4 workers) per run, over the paper's rows:

- DDP, and the same-size dense control: DDP at model.inner_width = C (the tensors of N-SDP
  forward's subnetwork, docs/sdp.md "The dense control");
- N-SDP and B-SDP, backward and forward masking, at C = 0.5, under both protocols:
  same_iteration (DDP's steps) and flop_matched (1/C times the steps, the paper's);
- the dropout and stochastic-depth baselines at keep rate 0.5;
- the low-communication controls: DiLoCo at H = 10, alone and with N-SDP backward and forward at
  C = 0.5;
- N-SDP and B-SDP forward at C = 0.25 and 0.75, where the model admits it (llama_tiny has
  2 KV groups per layer: 4 workers cannot each hold a quarter of them under N-SDP), with the
  dense controls the model admits.

A row whose config the entrypoint refuses at K = 4 (replica_text's 2 blocks leave a worker
without one under B-SDP at C = 0.25 and 0.5) runs nothing: the table's header names it and why.

Every row is made the same way:

1. Budget (once per table, when OUT/budgets.json has none; `--budgets-only` stops after it):
   DDP on seed 0 at the default learning rate for the table's probe steps, evaluated 20 times;
   twice the step at which its smoothed metric settles (`sdp.metrics.convergence.settled_step`)
   is the table's step budget, written to OUT/budgets.json and into the table's header. A table
   whose probe did not settle runs its default steps and says so.
2. Learning rate: each row on seed 0 at its default learning rate times each grid factor; the
   best final quality, its gate aside, carries to its seeded runs; a best
   point on the grid's edge first extends the grid by a factor of 2 past it, up to twice
   (`sdp.analysis.lrgrid`; OUT/<table>_lr_grid.md).
3. Seeds: 5 for DDP, the dense controls and the C = 0.5 rows, 3 for the rest; seed 0 is the
   grid's run at the chosen rate.
4. The tables, their plots and claims.md, from the chosen runs only; the language table's header
   sets DDP's loss against unigram and bigram models of the same token streams.

The runs stay in --runs: a second call skips completed runs and resumes stopped ones, so the
work can be spread over several calls. OUT/runs keeps the config, summary and metrics of every
completed run (a few tens of KB each): a call first restores them into --runs, so the calls can
be spread over machines and sessions too, and a table can be rebuilt from what is committed.
`--rows` names the rows a call runs, the grids first, so a partial call leaves every row tuned
before any is seeded; the tables and claims.md hold every row whose grid and seeds are complete,
run by this call or an earlier one. A row's seeded runs sit in a folder of their rate
(seeds/<row>/lr_<rate>), so a grid extended later, whose choice moves, seeds its new rate anew.
`--plan` prints each table's runs, how many are left (by --runs and OUT/runs; a grid's later
extensions are counted one at a time), and their projected time at its probe's DDP step time,
and runs nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import numpy as np

from sdp.analysis import lrgrid
from sdp.analysis.reference import ngram_losses, reference_words
from sdp.analysis.tables import collect
from sdp.data.api import prepare_data
from sdp.data.local_text import cache_dir_for, list_files
from sdp.errors import ConfigError
from sdp.launching.sweep import run_sweep
from sdp.metrics.convergence import gate_metric, plateau, settled_step
from sdp.run.config import typed_config, validate
from sdp.rundir import CONFIG, SUMMARY, evaluations, read_summary, run_status

NPROC = 4
# The memory claims also read the estimator's table and the H200 measurements.
MEMORY_TABLE = Path("results/tables/memory_estimates.csv")
CUDA = Path("results/bench/cuda_memory_*.json")
BUDGETS = "budgets.json"
RUNS = "runs"  # OUT/runs: the run records
# What OUT/runs keeps of every completed run (what the tables read), so that a later call, with
# an empty --runs, on this machine or another, skips them.
RECORDED = (CONFIG, SUMMARY, "metrics.jsonl")
# table: (experiment, default steps, probe steps, dataset kind). The default steps run until a
# budget is measured; the probe is DDP's long run that measures it.
TABLES = {
    # Vision: ResNet on Fashion-MNIST (the paper's ResNet-18 / CIFAR rows).
    "vision": ("replica_fmnist", 1000, 1000, "image"),
    # Language: LLaMA on the Python standard library's sources (the paper's LLaMA / FineWeb rows).
    # Its loss never settles within reach (a power law: the last fifth of a 1000-step and a
    # 2000-step probe both gain 1.5%), so it runs 1080 steps, 20 tokens a parameter (Chinchilla's
    # compute-optimal ratio; docs/experiments.md "Sizing the replica tables").
    "language": ("replica_text", 1080, 1000, "text"),
}
EVALS = 5  # evaluations per run: the gate reads the last two fifths, the costs to target all five
PROBE_EVALS = 20
# A run's time beyond its steps on 2 cores: 4 processes' launch and imports, the data, 5
# evaluations of the 10,000 eval images (measured on replica_fmnist: 13 s + 5 x 1.3 s).
RUN_OVERHEAD_S = 20
SDP = ("n_sdp_backward", "n_sdp_forward", "b_sdp_backward", "b_sdp_forward")
COVERAGES = {  # the coverage rows beside C = 0.5, by table: (variant, C)
    "vision": [(v, c) for v in ("n_sdp_forward", "b_sdp_forward") for c in (0.25, 0.75)],
    "language": [("b_sdp_forward", 0.25), ("b_sdp_forward", 0.75), ("n_sdp_forward", 0.75)],
}
DILOCO = ("outer=diloco", "outer.sync_every=10")
DENSE = {"vision": (0.25, 0.5, 0.75), "language": (0.5,)}  # inner widths the tiny models admit


@dataclass(frozen=True)
class Row:
    """One row of a table: its name (a folder name) and overrides, and how many seeds it gets."""

    name: str
    overrides: tuple[str, ...]
    full_seeds: bool  # DDP, a dense control or C = 0.5: the full seed count


def rows(table: str) -> list[Row]:
    """The rows of `table`, in the order they run."""
    out = [Row("ddp", ("variant=ddp",), True)]
    out += [Row(f"dense-w{w:g}", ("variant=ddp", f"model.inner_width={w:g}"), True) for w in DENSE[table]]
    for v in (*SDP, "dropout", "stochastic_depth"):
        out.append(Row(f"{v}-c0.5", (f"variant={v}", "masking.coverage=0.5"), True))
    for v in SDP:
        matched = (f"variant={v}", "masking.coverage=0.5", "trainer.protocol=flop_matched")
        out.append(Row(f"{v}-c0.5-flop_matched", matched, True))
    out += [Row(f"{v}-c{c:g}", (f"variant={v}", f"masking.coverage={c:g}"), False) for v, c in COVERAGES[table]]
    # The low-communication controls (docs/lowcomm.md): DiLoCo at H = 10, alone and under SDP.
    out.append(Row("diloco-h10", ("variant=ddp", *DILOCO), False))
    for v in ("n_sdp_backward", "n_sdp_forward"):
        out.append(Row(f"{v}-c0.5-diloco-h10", (f"variant={v}", "masking.coverage=0.5", *DILOCO), False))
    return out


def selected(table: str, patterns: list[str] | None) -> list[Row]:
    """The rows of `table` that a pattern of --rows matches (all of them without --rows)."""
    return [r for r in rows(table) if patterns is None or any(fnmatch(r.name, p) for p in patterns)]


def table_overrides(
    table: str, steps: int | None = None, *, evals: int = EVALS, eval_every: int | None = None, experiment=None
):
    """The overrides every run of `table` shares, at `steps` (default: the table's default steps),
    evaluated `evals` times (or every `eval_every` steps); `experiment` replaces the table's."""
    default_experiment, default, _, _ = TABLES[table]
    steps = steps or default
    return [
        f"experiment={experiment or default_experiment}",
        f"trainer.max_steps={steps}",
        f"trainer.eval_every={eval_every or max(1, steps // evals)}",
        "trainer.progress=false",
        "logger=none",
    ]


def parse_args(argv: list[str], *, doc: str, name: str) -> tuple[argparse.Namespace, list[str]]:
    """--runs outputs/NAME, --out results/cpu_replica (or outputs/NAME/tables), --tables, and
    --seeds (0 1 2) or cpu_replica's own options; the rest are overrides (an unknown option is refused)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--runs", type=Path, default=Path(f"outputs/{name}"))
    # Only the converged tables are results; an exploratory sweep's tables stay with its runs.
    out = Path("results/cpu_replica") if name == "cpu_replica" else Path(f"outputs/{name}/tables")
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--tables", nargs="+", choices=list(TABLES), default=list(TABLES))
    if name != "cpu_replica":  # whose rows get their seed counts (--seed-counts)
        parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    else:
        parser.add_argument("--budgets-only", action="store_true", help="measure the missing budgets, then stop")
        parser.add_argument("--plan", action="store_true", help="print the runs and their projected time, run nothing")
        parser.add_argument("--grid", nargs="+", type=float, default=list(lrgrid.FACTORS), help="lr factors")
        parser.add_argument("--seed-counts", nargs=2, type=int, default=[5, 3], metavar=("FULL", "REST"))
        parser.add_argument("--rows", nargs="+", metavar="PATTERN", help="only the rows these match (fnmatch)")
    args, overrides = parser.parse_known_args(argv)
    unknown = [a for a in overrides if a.startswith("-")]
    if unknown:  # else it would reach Hydra as an override
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args, overrides


def sweep(overrides: list[str], where: Path, table: str) -> int:
    return run_sweep([*overrides, f"sweep.nproc={NPROC}", f"sweep.dir={where}", f"sweep.name={table}"])


def run_dirs(where: Path) -> list[Path]:
    """The run dirs a sweep made under `where`, in job order."""
    return sorted(p for p in where.glob("*") if (p / CONFIG).is_file()) if where.is_dir() else []


# ---------------------------------------------------------------- the run records


def _summaries(root: Path) -> list[Path]:
    return sorted(root.glob(f"**/{SUMMARY}")) if root.is_dir() else []


def _copy_run(source: Path, target: Path) -> None:
    """The RECORDED files of run dir `source` into `target`."""
    target.mkdir(parents=True, exist_ok=True)
    for name in RECORDED:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)


def restore(records: Path, runs: Path) -> int:
    """Copy each recorded run into --runs where its run dir is missing (so its sweep skips it as
    completed, or refuses it when its config is no longer the one asked for); how many."""
    missing = [s.parent for s in _summaries(records) if not (runs / s.parent.relative_to(records)).exists()]
    for run_dir in missing:
        _copy_run(run_dir, runs / run_dir.relative_to(records))
    return len(missing)


def record(runs: Path, records: Path) -> None:
    """Copy the config, summary and metrics of every completed run under --runs into OUT/runs."""
    for summary in _summaries(runs):
        if run_status(summary.parent) == "completed":
            _copy_run(summary.parent, records / summary.parent.relative_to(runs))


# ---------------------------------------------------------------- 1. the step budget


def measure_budget(table: str, runs: Path, extra: list[str]) -> dict:
    """DDP's probe on seed 0, and the budget it gives (`budget` None when it did not settle)."""
    _, _, probe, kind = TABLES[table]
    where = runs / table / "probe"
    failed = sweep([*table_overrides(table, probe, evals=PROBE_EVALS), *extra, "variant=ddp", "seed=0"], where, table)
    (run_dir,) = run_dirs(where) or [None]
    summary = read_summary(run_dir) if run_dir else None
    if failed or summary is None or summary.status != "completed":
        return {"probe_steps": probe, "settled_step": None, "budget": None, "reason": "the probe did not complete"}
    evals = evaluations(run_dir, gate_metric(kind))
    settled, gate = settled_step(evals, steps=probe), plateau(evals, steps=probe, metric=gate_metric(kind))
    return {
        "probe_steps": probe,
        "settled_step": settled,
        "budget": None if settled is None else int(math.ceil(2 * settled / 10) * 10),
        "final": getattr(summary, gate_metric(kind)),
        "step_time_s": summary.step_time_s,
        "metric": gate_metric(kind),
        "measured": time.strftime("%Y-%m-%d"),
        "reason": "" if settled is not None else _unsettled(gate),
    }


def _unsettled(gate: dict) -> str:
    """Why a probe gave no budget: it failed the 0.5% gate that `settled_step` applies (whatever
    its table's own gate), and by how much."""
    why = "the probe did not settle"
    if gate["change"] is None:
        return why
    metric, limit = gate["metric"].replace("_", " "), gate["threshold"]
    return f"{why}: its smoothed {metric} moved {gate['change']:.2%} over its last fifth, against {limit:.1%}"


def budgets(out: Path) -> dict:
    path = out / BUDGETS
    return json.loads(path.read_text()) if path.is_file() else {}


def budget_note(table: str, found: dict | None) -> str:
    _, default, probe, _ = TABLES[table]
    if not found or not found.get("budget"):
        why = (found or {}).get("reason") or "no probe has run"
        return f"Step budget: **not measured** ({why}); the runs take the default {default} steps."
    return (
        f"Step budget: {found['budget']} steps, twice the step ({found['settled_step']}) from which DDP's smoothed "
        f"{found['metric'].replace('_', ' ')} stayed within 0.5% of its final {found['final']:.4f} in a probe of "
        f"{found['probe_steps']} steps on seed 0 (measured {found['measured']}, OUT/{BUDGETS})."
    )


def plan_line(table: str, found: dict | None, args: argparse.Namespace, extra: list[str]) -> str:
    """The table's runs, those not yet completed (under --runs or recorded in OUT/runs) and their
    projected time, at its probe's DDP step time (SDP rows differ); the rows its model does not
    admit are left out."""
    steps = (found or {}).get("budget") or TABLES[table][1]
    runs = left = steps_left = 0
    base = [*table_overrides(table, steps), *extra]
    chosen = [row for row in selected(table, args.rows) if refusal(base, row) is None]
    for row in chosen:
        n = len(args.grid) + seed_count(row, args.seed_counts) - 1
        todo = runs_left(table, row, args, default_lr(base, row))
        runs, left = runs + n, left + todo
        steps_left += todo * steps * (2 if "trainer.protocol=flop_matched" in row.overrides else 1)
    step_s = (found or {}).get("step_time_s")
    if step_s:
        hours = f"{(steps_left * step_s + left * RUN_OVERHEAD_S) / 3600:.1f} h at DDP's {step_s:.3f} s a step"
        hours += f" and {RUN_OVERHEAD_S} s a run"
    else:
        hours = "no step time yet"
    return (
        f"cpu_replica: {table}: {len(chosen)} rows, {runs} runs of {steps} steps; {left} runs left, "
        f"{steps_left} steps: {hours}"
    )


def runs_left(table: str, row: Row, args: argparse.Namespace, lr0: float) -> int:
    """The runs the row still needs, by what --runs and OUT/runs hold: its grid's missing points
    (and one extension where its best point is on the edge), then its seeds at the chosen rate."""
    kind, seeds = TABLES[table][3], seed_count(row, args.seed_counts) - 1
    by_dir = {}
    for root in (args.out / RUNS, args.runs):  # a run under --runs wins over its record
        by_dir |= {p.run_dir.relative_to(root): p for p in grid_points(root / table / "grid" / row.name, lr0, kind)}
    points = list(by_dir.values())
    left, best = grid_left(points, args.grid, kind), lrgrid.choose(points, kind)
    if left or best is None:
        return left + seeds
    seeded = set()
    for root in (args.out / RUNS, args.runs):
        where = seed_dir(root, table, row, best.lr)
        seeded |= {d.relative_to(root) for d in run_dirs(where) if run_status(d) == "completed"}
    return max(0, seeds - len(seeded))


# ---------------------------------------------------------------- 2. the grid, 3. the seeds


# (overrides, row) -> (the row's default learning rate, why the entrypoint refuses it at K = NPROC or
# None): composing a config costs a few tenths of a second, and a call asks for every row's.
_COMPOSED: dict[tuple, tuple[float, str | None]] = {}


def composed(base: list[str], row: Row) -> tuple[float, str | None]:
    """The row's default learning rate and its refusal at K = NPROC (its error line; None when
    the entrypoint admits it), from one composition of its config."""
    key = (tuple(base), row)
    if key not in _COMPOSED:
        lr, why = math.nan, None
        try:
            cfg = typed_config([*base, *row.overrides])
            lr = cfg.optim.lr
            validate(cfg, world_size=NPROC, offline=True, check_data=False)
        except ConfigError as err:
            why = str(err)
        _COMPOSED[key] = (lr, why)
    return _COMPOSED[key]


def default_lr(base: list[str], row: Row) -> float:
    return composed(base, row)[0]


def refusal(base: list[str], row: Row) -> str | None:
    """Why the entrypoint refuses the row's config at K = NPROC (its error line), or None."""
    return composed(base, row)[1]


def grid(table: str, row: Row, base: list[str], factors: list[float], lr0: float, runs: Path) -> list:
    """Run the row's grid on seed 0: `factors`, any the row already ran, and one factor of 2 past
    the edge while its best point lies there, up to lrgrid.EXTENSIONS more; its points, each
    read from its run dir."""
    where, kind, limit = runs / table / "grid" / row.name, TABLES[table][3], len(factors) + lrgrid.EXTENSIONS
    known = [p.factor for p in grid_points(where, lr0, kind)]  # in job order, each keeping its job dir
    factors = known + [f for f in factors if f not in known]
    while True:
        rates = ",".join(f"{lr0 * f:.6g}" for f in factors)  # the points run before keep their job dirs
        sweep([*base, *row.overrides, f"optim.lr={rates}", "seed=0"], where, table)
        points = grid_points(where, lr0, kind)
        beyond = next_factor(points, kind, limit)
        if beyond is None:
            return points
        factors.append(beyond)


def next_factor(points: list, kind: str, limit: int) -> float | None:
    """The factor a grid runs next: one past its edge while its best point lies there and it has
    fewer than `limit` points; None when the grid is done."""
    beyond, factors = lrgrid.extension(points, kind), [p.factor for p in points]
    return None if beyond is None or beyond in factors or len(factors) >= limit else beyond


def grid_left(points: list, factors: list[float], kind: str) -> int:
    """The runs a row's grid of `factors` still needs: those not yet completed, else one while it
    would extend past its edge; 0 when it is done."""
    missing = len(set(factors) - {p.factor for p in points if p.status == "completed"})
    return missing or int(next_factor(points, kind, len(factors) + lrgrid.EXTENSIONS) is not None)


def seed_count(row: Row, counts: list[int]) -> int:
    """The runs a row gets at its chosen rate (`--seed-counts` FULL or REST), seed 0 included."""
    return counts[0] if row.full_seeds else counts[1]


def grid_points(where: Path, lr0: float, kind: str) -> list:
    """The grid's points under `where` (a point's factor: its lr over the default `lr0`)."""
    return [lrgrid.point(run_dir, default_lr=lr0, kind=kind) for run_dir in run_dirs(where)]


def seed_dir(runs: Path, table: str, row: Row, lr: float) -> Path:
    """Where a row's seeded runs at `lr` go: one folder a rate, so that a grid extended later,
    whose choice moves, seeds its new rate beside the old one's runs instead of being refused."""
    return runs / table / "seeds" / row.name / f"lr_{lr:.6g}"


def seeded(table: str, row: Row, base: list[str], chosen, counts: list[int], runs: Path) -> list[Path]:
    """The row's seeded runs at the chosen lr (seed 0: the grid's run); every run dir of the row."""
    n = seed_count(row, counts)
    where = seed_dir(runs, table, row, chosen.lr)
    if n > 1:
        seeds = ",".join(str(s) for s in range(1, n))
        sweep([*base, *row.overrides, f"optim.lr={chosen.lr:.6g}", f"seed={seeds}"], where, table)
    return [chosen.run_dir, *run_dirs(where)[: n - 1]]


def recorded(table: str, row: Row, args: argparse.Namespace, lr0: float) -> tuple[list, list[Path]] | None:
    """A row this call does not run, when its grid and its seeds at the chosen rate are complete
    under --runs (run or restored before): its grid's points and the chosen run dirs; else None.
    Its grid is complete under this call's --grid or the default one: a call that gives one row a
    factor the others never ran still tabulates them."""
    kind = TABLES[table][3]
    points = grid_points(args.runs / table / "grid" / row.name, lr0, kind)
    best = lrgrid.choose(points, kind)
    if best is None or min(grid_left(points, factors, kind) for factors in (args.grid, list(lrgrid.FACTORS))):
        return None
    n = seed_count(row, args.seed_counts)
    dirs = [best.run_dir, *run_dirs(seed_dir(args.runs, table, row, best.lr))[: n - 1]]
    complete = len(dirs) == n and all(run_status(d) == "completed" for d in dirs)
    return (points, dirs) if complete else None


def text_reference(table: str, extra: list[str], ddp_dirs: list[Path]) -> str:
    """The language table's line on its losses: unigram and bigram models of its token streams
    (`sdp.analysis.reference`) against DDP's mean eval loss."""
    cfg = typed_config([*table_overrides(table), *extra]).dataset
    prepare_data(cfg)  # the runs made the cache; this only finds it
    directory = cache_dir_for(cfg, list_files(cfg))
    train, evaluation = (np.load(directory / f"{split}.npy", mmap_mode="r") for split in ("train", "eval"))
    losses = [s.eval_loss for s in map(read_summary, ddp_dirs) if s is not None and s.eval_loss is not None]
    ddp = sum(losses) / len(losses) if losses else None
    return reference_words(ngram_losses(train, evaluation, cfg.vocab_size), ddp)


def main(argv: list[str]) -> int:
    args, extra = parse_args(argv, doc=__doc__, name="cpu_replica")
    start, found, records = time.monotonic(), budgets(args.out), args.out / RUNS
    for table in args.tables if not args.plan else ():
        restored = restore(records / table, args.runs / table)
        print(f"cpu_replica: {table}: {restored} recorded runs restored from {records / table}")
    for table in [t for t in args.tables if t not in found and not args.plan]:
        found[table] = measure_budget(table, args.runs, extra)
        record(args.runs / table, records / table)
        print(f"cpu_replica: {budget_note(table, found[table])}")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / BUDGETS).write_text(json.dumps(found, indent=2) + "\n")
    if args.budgets_only or args.plan:
        for table in args.tables if args.plan else ():
            print(plan_line(table, found.get(table), args, extra))
        return 0
    chosen, roots, notes, missing = {}, {}, {}, 0
    for table in args.tables:
        base = [*table_overrides(table, (found.get(table) or {}).get("budget")), *extra]
        grids, done = tune(table, args, base, chosen)
        missing += sum(best is None for (t, _), best in chosen.items() if t == table)
        path = args.out / f"{table}_lr_grid.md"
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(lrgrid.grid_markdown(table, grids, TABLES[table][3], command="python scripts/cpu_replica.py"))
        notes[table] = [
            budget_note(table, found.get(table)),
            f"Learning rates: chosen on a grid, [{path.name}]({path.name}).",
            *filter(None, [refusals_note(table, base)]),
        ]
        roots[table] = done
        record(args.runs / table, records / table)
        print(f"cpu_replica: {table}'s grids done, {(time.monotonic() - start) / 60:.1f} min so far")
    for (table, row), best in chosen.items():
        if best is not None:
            base = [*table_overrides(table, (found.get(table) or {}).get("budget")), *extra]
            roots[table][row] = seeded(table, row, base, best, args.seed_counts, args.runs)
    for table in args.tables:
        record(args.runs / table, records / table)
        ddp = next((dirs for row, dirs in roots[table].items() if row.name == "ddp"), None)
        if ddp and TABLES[table][3] == "text":
            notes[table].append(text_reference(table, extra, ddp))
    print(f"cpu_replica: seeds done, {(time.monotonic() - start) / 60:.1f} min in all")
    roots = {table: [d for row in rows(table) for d in by_row.get(row, [])] for table, by_row in roots.items()}
    return finish(args, roots, notes, missing)


def refusals_note(table: str, base: list[str]) -> str | None:
    """The header's line on the rows this table's model does not admit at K = NPROC."""
    by_reason: dict[str, list[str]] = {}
    for row in rows(table):
        if (why := refusal(base, row)) is not None:
            by_reason.setdefault(why, []).append(row.name)
    if not by_reason:
        return None
    listed = "; ".join(f"{', '.join(names)} (`{why}`)" for why, names in by_reason.items())
    return f"Rows this model does not admit at K = {NPROC}, so not run: {listed}."


def tune(table: str, args: argparse.Namespace, base: list[str], chosen: dict) -> tuple[dict, dict]:
    """Run the grids of the table's selected rows, their choices into `chosen`; (every row's grid
    points, the chosen run dirs of each row this call does not run whose runs are complete):
    every complete row is tabulated, so calls over different rows build one table."""
    grids, done, ran = {}, {}, selected(table, args.rows)
    for row in rows(table):
        lr0 = default_lr(base, row)
        if refusal(base, row) is not None:
            continue
        if row in ran:
            grids[row.name] = grid(table, row, base, args.grid, lr0, args.runs)
            chosen[table, row] = lrgrid.choose(grids[row.name], TABLES[table][3])
        elif (complete := recorded(table, row, args, lr0)) is not None:
            grids[row.name], done[row] = complete
    return grids, done


def finish(args: argparse.Namespace, roots: dict, notes: dict, missing: int) -> int:
    """The tables and claims.md from the chosen runs; 1 when a row had no run to choose."""
    memory = dict(memory_table=MEMORY_TABLE, cuda=tuple(sorted(CUDA.parent.glob(CUDA.name))))
    command = "python scripts/cpu_replica.py (make tables)"
    chosen_dirs = [d for dirs in roots.values() for d in dirs]
    written = collect(chosen_dirs, args.out, command=command, claims=True, notes=_by_model(roots, notes), **memory)
    for path in written:
        print(f"wrote {path}")
    return 1 if missing else 0


def _by_model(roots: dict, notes: dict) -> dict:
    """The notes keyed as collect names its tables (<model>_<dataset>, from a run of the table)."""
    out = {}
    for table, dirs in roots.items():
        s = read_summary(dirs[0]) if dirs else None
        if s is not None:
            out[f"{s.model}_{s.dataset}"] = notes[table]
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
