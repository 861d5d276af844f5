"""The low-communication comparison (`make lowcomm`, scripts/lowcomm.py): DDP, DiLoCo and SDP with
and without DiLoCo on one model and data, from their run dirs.

Per table (one model on one dataset) it writes `DIR/<table>.md` and `.csv`, one row per variant
(seeds aggregated: mean ± sd): quality (eval accuracy, or eval loss), whether the row's runs
converged (the tables' check: the eval metric between 80% and 100% of the steps), the bytes one
worker sent in the whole run (the busiest rank's: every kind, the outer loop's syncs and
backward masking's refresh included), the per-rank memory on the device (weights, gradients,
optimizer state) and of the outer loop (theta_prev and its momentum, on outer.backup_device), and
the training time (the mean timed step times the steps); and `DIR/<table>_bytes.png`, quality
against the bytes sent.
"""

from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from pathlib import Path

from sdp.analysis.tables import MIB, convergence, find_runs, gates, variant_label
from sdp.metrics.memory import outer_keys
from sdp.rundir import Summary

COLUMNS = (
    "variant",
    "runs",
    "seeds",
    "steps",
    "quality",
    "quality_sd",
    "sent_mib_per_worker",
    "device_mib_per_rank",
    "outer_mib_per_rank",
    "outer_on",
    "train_time_s",
    "syncs",
)


def _sent(s: Summary) -> float:
    """Bytes the busiest rank sent over the run: its mean per step times the steps."""
    per_rank = s.comm_bytes_per_step_per_rank or [s.comm_bytes_per_step or 0.0]
    return max(per_rank) * (s.steps or 0)


def _mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def row_of(variant: str, members: list[tuple[Path, Summary]], kind: str) -> dict:
    sums = [s for _, s in members]
    metric = [s.eval_acc if kind == "image" else s.eval_loss for s in sums]
    outer = sums[0].outer or {}
    memory = sums[0].memory
    row = {
        "variant": variant,
        "runs": len(sums),
        "seeds": sorted(s.seed for s in sums),
        "steps": sums[0].steps,
        "quality": _mean_sd(metric)[0],
        "quality_sd": _mean_sd(metric)[1],
        "sent_mib_per_worker": _mean_sd([_sent(s) / MIB for s in sums])[0],
        "device_mib_per_rank": _mean_sd([s.static_bytes / MIB for s in sums])[0],
        "outer_mib_per_rank": sum(memory[k] for k in outer_keys(memory)) / MIB,
        "outer_on": outer.get("backup_device", "—"),
        "train_time_s": _mean_sd([(s.step_time_s or 0.0) * (s.steps or 0) for s in sums])[0],
        "syncs": outer.get("syncs"),
        "run_dirs": [str(d) for d, _ in members],
    }
    row.update(gates(members, kind))
    row["convergence"] = convergence(row, kind)
    return row


def lowcomm_tables(root: Path) -> dict[str, dict]:
    """{table: {"rows": [...], "kind": image|text, "incomplete": n}} from the run dirs under `root`."""
    groups: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    kinds, incomplete = {}, defaultdict(int)
    for run_dir, s in find_runs([root]):
        table = f"{s.model}_{s.dataset}"
        if s.status != "completed":
            incomplete[table] += 1
            continue
        kinds[table] = "image" if s.eval_acc is not None else "text"
        groups[table][variant_label(s)].append((run_dir, s))
    out = {}
    for table, by_variant in groups.items():
        rows = [row_of(v, members, kinds[table]) for v, members in by_variant.items()]
        rows.sort(key=lambda r: (r["variant"] != "DDP", "DiLoCo" in r["variant"], r["variant"]))
        out[table] = {"rows": rows, "kind": kinds[table], "incomplete": incomplete[table]}
    return out


def _f(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown(table: str, info: dict, *, command: str) -> str:
    metric = "eval acc" if info["kind"] == "image" else "eval loss"
    lines = [
        f"# Low communication: {table}",
        "",
        f"Made by `{command}`. Quality is the mean ± sd over the seeds listed; bytes are one worker's "
        "(the busiest rank's) over the whole run, every kind included; memory is per rank, from the run's own "
        "tensors: on the device (weights, gradients, optimizer state) and the outer loop's theta_prev and "
        "momentum (where `outer on` says). Train time: the mean timed step times the steps, on this machine's "
        "2 cores shared by the 4 processes. Every row used the table's one inner learning rate and DiLoCo's "
        "outer lr 0.7 and momentum 0.9, none tuned.",
        "",
        f"| variant | seeds | steps | {metric} | MiB sent per worker | device MiB per rank | outer MiB per rank "
        "| outer on | train time s | syncs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in info["rows"]:
        quality = _f(r["quality"], ".4f") + (f" ± {r['quality_sd']:.4f}" if r["quality_sd"] is not None else "")
        lines.append(
            f"| {r['variant']} | {', '.join(map(str, r['seeds']))} | {r['steps']} | {quality} "
            f"| {_f(r['sent_mib_per_worker'], ',.1f')} | {_f(r['device_mib_per_rank'], '.1f')} "
            f"| {_f(r['outer_mib_per_rank'], '.1f')} | {r['outer_on']} | {_f(r['train_time_s'], '.0f')} "
            f"| {_f(r['syncs'], 'd')} |"
        )
    lines += ["", "Convergence (the eval metric between 80% and 100% of the steps; < 1% passes):", ""]
    lines += [f"- {r['convergence']}" for r in info["rows"]]
    if info["incomplete"]:
        lines += ["", f"{info['incomplete']} run(s) did not complete and are not in the rows."]
    return "\n".join(lines) + "\n"


def plot(table: str, info: dict, path: Path) -> Path:
    """Quality against the bytes one worker sent, one point per row (the sd as an error bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in info["rows"]:
        if r["quality"] is None or not r["sent_mib_per_worker"]:
            continue
        marker = "s" if "DiLoCo" in r["variant"] else "o"
        ax.errorbar(r["sent_mib_per_worker"], r["quality"], yerr=r["quality_sd"] or 0, fmt=marker, capsize=3)
        ax.annotate(
            r["variant"],
            (r["sent_mib_per_worker"], r["quality"]),
            fontsize=7,
            xytext=(4, 3),
            textcoords="offset points",
        )
    ax.set_xscale("log")
    ax.set_xlabel("MiB sent per worker, whole run (log)")
    ax.set_ylabel("eval accuracy" if info["kind"] == "image" else "eval loss")
    ax.set_title(f"{table}: quality against communication")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(root: Path, out: Path, *, command: str) -> list[Path]:
    """Every table under `root` into `out` (markdown, csv, the plot); returns the files written."""
    tables = lowcomm_tables(root)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for table, info in sorted(tables.items()):
        md = out / f"{table}.md"
        md.write_text(markdown(table, info, command=command))
        path = out / f"{table}.csv"
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(COLUMNS)
            w.writerows([[r[c] for c in COLUMNS] for r in info["rows"]])
        written += [md, path, plot(table, info, out / f"{table}_bytes.png")]
    return written
