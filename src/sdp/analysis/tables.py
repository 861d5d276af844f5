"""Paper tables and plots from run dirs (the command is `python -m sdp.collect ROOT [ROOT ...] --out DIR`).

Reads every run dir under the roots (`summary.json`, `metrics.jsonl`; never the
W&B API) and writes, per table (one model on one dataset):

- `DIR/<model>_<dataset>.md` and `.csv`: one row per variant x coverage x
  protocol, seeds aggregated (mean ± std over completed runs): quality (eval
  accuracy, or eval loss and perplexity), the busiest rank's live-tensor peak
  and static bytes (and the CUDA allocator's peak when measured) with their
  change against the table's DDP row, per-rank throughput, communication and
  step time;
- `DIR/<model>_<dataset>_loss.png` (training loss per row), `_memory.png`
  (peak per rank) and `_quality.png` (quality against coverage, DDP as a line).

Runs that did not complete are counted in the table's note, not in its rows.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from sdp.analysis.claims import (
    claims_markdown,
    points_from_cuda,
    points_from_memory_table,
    points_from_tables,
    quality_claims,
)
from sdp.analysis.target import costs_to_target, curve, target_value
from sdp.errors import ConfigError
from sdp.metrics.convergence import gate_metric, plateau
from sdp.paths import DamagedFile, describe, read_json_lines, read_yaml_mapping
from sdp.run.config import RunConfig, by_dotted_key
from sdp.rundir import CONFIG, MASK, METRICS, SUMMARY, Summary, evaluations, load_summary
from sdp.rundir import variant_label as label_of

GIB, MIB = 2**30, 2**20
CLAIMS_FILE = "claims.md"


def variant_label(summary: Summary) -> str:
    """The paper's name of a run's variant, plus the memory-saving methods stacked on it."""
    return label_of(
        summary.masking,
        granularity=summary.strategy.get("granularity"),
        parallelism=summary.parallelism,
        fsdp_degree=summary.strategy.get("fsdp_degree", 1),
        activation_checkpointing=summary.activation_checkpointing,
        mixed_precision=summary.mixed_precision,
        capacity=(summary.strategy.get("mask") or {}).get("capacity"),
        outer=summary.outer,
        inner_width=summary.inner_width,
    )


def find_runs(roots: list[Path]) -> list[tuple[Path, Summary]]:
    """Every run dir under the roots (a dir with a summary.json), in path order; a summary that
    cannot be read is a DamagedFile (one line naming it), never a run silently left out."""
    found = []
    for root in roots:
        if not Path(root).is_dir():
            raise ConfigError("roots", str(root), "is not a directory of run dirs")
        for path in sorted(Path(root).rglob(SUMMARY)):
            found.append((path.parent, load_summary(path.parent)))
    return found


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


# Student's t, two-sided 95%, by degrees of freedom (1-30); beyond 30, the normal's 1.96.
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131)
T95 += (2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def ci95(std: float | None, n: int) -> float | None:
    """The half-width of the 95% confidence interval of a mean of n runs with standard deviation
    `std`: t(0.975, n - 1) * std / sqrt(n); None below two runs."""
    if std is None or n < 2:
        return None
    return (T95[n - 2] if n - 1 <= len(T95) else 1.96) * std / math.sqrt(n)


# The top-level keys of a run's config.yaml.
RUN_KEYS = {f.name for f in dataclasses.fields(RunConfig)} - {"record"}  # record: the file itself
# Settings that do not make two runs different rows: seeds are averaged, the rest is bookkeeping.
NOT_A_SETTING = ("seed", "name", "run_dir", "output_root", "logger")
NOT_A_TRAINER_SETTING = ("progress", "checkpoint_every", "keep_checkpoints", "stop_at_step", "plateau_threshold")


def settings(run_dir: Path) -> dict:
    """The run's config.yaml without seeds and bookkeeping: runs with equal settings are one row."""
    path = run_dir / CONFIG
    config = read_yaml_mapping(path) if path.is_file() else {}
    foreign = sorted(str(k) for k in config if k not in RUN_KEYS)
    if foreign:
        raise DamagedFile(path, f"is not a run's config (it holds {', '.join(foreign[:3])})")
    config = {k: v for k, v in config.items() if k not in NOT_A_SETTING}
    trainer = {k: v for k, v in config.get("trainer", {}).items() if k not in NOT_A_TRAINER_SETTING}
    masking = {k: v for k, v in config.get("masking", {}).items() if k != "seed"}
    return {**config, "trainer": trainer, "masking": masking}


def build_rows(runs: list[tuple[Path, Summary]]) -> dict[str, dict]:
    """{table: {"rows": [...], "incomplete": n, "kind": text|image}} from completed runs."""
    groups: dict[str, dict[tuple, list]] = defaultdict(lambda: defaultdict(list))
    incomplete: dict[str, int] = defaultdict(int)
    kinds: dict[str, str] = {}
    for run_dir, s in runs:
        table = f"{s.model}_{s.dataset}"
        if s.status != "completed":
            incomplete[table] += 1
            continue
        kinds[table] = "text" if s.eval_token_acc is not None or s.throughput_unit == "tokens/s" else "image"
        config = settings(run_dir)
        key = (variant_label(s), s.coverage, s.protocol, json.dumps(config))
        groups[table][key].append((run_dir, s))
    tables = {}
    for table, by_key in groups.items():
        # Rows of one variant, C and protocol that differ in other settings say their values of them.
        siblings: dict[tuple, list[dict]] = defaultdict(list)
        for label, coverage, protocol, config in by_key:
            siblings[(label, coverage, protocol)].append(by_dotted_key(json.loads(config)))
        rows, members_of = [], []
        for (label, coverage, protocol, config), members in by_key.items():
            flat, others = by_dotted_key(json.loads(config)), siblings[(label, coverage, protocol)]
            differing = sorted({k for o in others for k in o.keys() | flat.keys() if o.get(k) != flat.get(k)})
            if differing:
                label += " [" + ", ".join(f"{k}={flat.get(k)}" for k in differing[:3]) + "]"
            sums = [s for _, s in members]
            row = {"variant": label, "coverage": coverage, "protocol": protocol, "runs": len(sums)}
            row["steps"] = sums[0].steps
            row["inner_width"] = sums[0].inner_width
            row["lr"] = (json.loads(config).get("optim") or {}).get("lr")
            row.update(pilot_columns(json.loads(config), sums[0], kinds[table]))
            row["spectral_gap"] = spectral_gap(members[0][0], sums[0])
            if kinds[table] == "image":
                row["eval_acc"], row["eval_acc_std"] = _mean_std([s.eval_acc for s in sums])
            row["eval_loss"], row["eval_loss_std"] = _mean_std([s.eval_loss for s in sums])
            for metric in ("eval_acc", "eval_loss"):
                row[f"{metric}_ci95"] = ci95(row.get(f"{metric}_std"), len(sums))
            if kinds[table] == "text" and row["eval_loss"] is not None:
                row["eval_ppl"] = math.exp(row["eval_loss"])
            row["peak_gib"], _ = _mean_std([s.memory["peak_bytes"] / GIB for s in sums if s.memory.get("peak_bytes")])
            row["static_gib"], _ = _mean_std([s.static_bytes / GIB for s in sums])
            cuda = [s.memory.get("cuda_max_allocated_bytes") for s in sums]
            row["cuda_peak_gib"] = _mean_std([c / GIB for c in cuda if c])[0]
            row["throughput_per_rank"], _ = _mean_std([s.tokens_or_samples_per_s_per_rank for s in sums])
            row["comm_mib_per_step"], _ = _mean_std([s.comm_bytes_per_step / MIB for s in sums])
            row["step_time_s"], _ = _mean_std([s.step_time_s for s in sums])
            row["run_dirs"] = [str(d) for d, _ in members]
            row.update(gates(members, kinds[table]))
            rows.append(row)
            members_of.append(members)
        ddp = next((r for r in rows if r["variant"] == "DDP"), None)
        final = ddp and ddp[gate_metric(kinds[table])]
        target = None if final is None else target_value(final, kinds[table])
        for row, members in zip(rows, members_of, strict=True):
            row.update(costs_to_target(members, target, kinds[table]))
        for row in rows:
            for key in ("peak_gib", "static_gib", "cuda_peak_gib"):
                base = ddp.get(key) if ddp else None
                row[f"{key}_vs_ddp"] = row[key] / base - 1 if base and row.get(key) is not None else None
        order = ["DDP", "FSDP", "Dropout", "Stochastic depth"]
        base = [r["variant"].split(" (inner width")[0] for r in rows]  # dense controls after DDP
        rank = {id(r): order.index(b) if b in order else 9 for r, b in zip(rows, base, strict=True)}
        rows.sort(key=lambda r: (rank[id(r)], r["variant"], -r["coverage"]))
        tables[table] = {"rows": rows, "incomplete": incomplete[table], "kind": kinds[table]}
        tables[table]["convergence"] = convergence(ddp, kinds[table]) if ddp else None
        tables[table]["not_converged"] = [r["variant"] for r in rows if not r["converged"]]
    return tables


def pilot_columns(config: dict, s: Summary, kind: str) -> dict:
    """What a row ran, as columns: a planner that reads the table as a pilot sweep
    (`sdp.plan objective=time_to_target quality=`) matches its variants and checks its scale."""
    masking, outer = config.get("masking") or {}, config.get("outer") or {}
    mode = masking.get("name", s.masking)
    looped = outer.get("name") not in (None, "none")
    return {
        "model": s.model,
        "kind": kind,
        "world_size": s.world_size,
        "global_batch": (config.get("trainer") or {}).get("global_batch_size"),
        "seq_len": (config.get("dataset") or {}).get("seq_len") if kind == "text" else None,
        "precision": s.mixed_precision,
        "masking": mode,
        "granularity": masking.get("granularity") if mode in ("backward", "forward") else None,
        "outer": outer["name"] if looped else None,
        "sync_every": outer.get("sync_every") if looped else None,
    }


def spectral_gap(run_dir: Path, s: Summary) -> float | None:
    """The mask's spectral gap (rho) from the run's mask.json (an SDP run's published mask), else
    from its summary; None without SDP. A mask.json that cannot be read is named in one line."""
    path = Path(run_dir) / MASK
    if not path.is_file():
        return (s.strategy.get("mask") or {}).get("spectral_gap")
    try:
        return json.loads(path.read_text())["spectral_gap"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DamagedFile(path, f"is not a mask record: {describe(err)}") from None


def gates(members: list[tuple[Path, Summary]], kind: str) -> dict:
    """A row's convergence gates, one a run (its summary.json's; for a run dir from before the
    gate, computed from its metrics.jsonl at the default threshold), and whether all pass."""
    out, metric = [], gate_metric(kind)
    for run_dir, s in members:
        out.append(s.convergence or plateau(evaluations(run_dir, metric), steps=s.steps or 0, metric=metric))
    return {"gates": out, "converged": bool(out) and all(g.get("plateaued") is True for g in out)}


def convergence(row: dict, kind: str) -> str:
    """A row's convergence gate in words: each run's change over its last fifth, and the verdict."""
    found = row["gates"]
    undecided = next((g for g in found if g.get("plateaued") is None), None)
    if undecided is not None:
        return f"{row['variant']}: not checked ({undecided.get('reason') or 'no gate'} in a run)"
    metric = found[0]["metric"].replace("_", " ")
    listed = ", ".join(f"{g['change']:.2%}" for g in found)
    spans = "/".join(sorted({f"{g['from_step']}-{g['to_step']}" for g in found}))
    limit = "/".join(f"{t:.1%}" for t in sorted({g["threshold"] for g in found}))
    if row["converged"]:
        verdict = f"passes (< {limit} in every run)"
    else:
        moved = sum(not g["plateaued"] for g in found)
        verdict = f"fails (>= {limit} in {moved} of its {len(found)} runs)"
    return (
        f"{row['variant']}'s smoothed {metric} moved by {listed} (its {len(found)} runs) over steps {spans}: {verdict}"
    )


def _fmt(value, spec: str = ".3f", std=None) -> str:
    if value is None:
        return "—"
    text = format(value, spec)
    return f"{text} ± {format(std, spec)}" if std else text


def _target_words(rows: list[dict], kind: str) -> str:
    target = next((r["target"] for r in rows if r.get("target") is not None), None)
    if target is None:
        return "none: no DDP result"
    if kind == "image":
        return f"99% of DDP's final eval accuracy, {100 * target:.2f}%"
    return f"an eval loss within 1% of DDP's final one, {target:.4f}"


def _to_target(r: dict) -> list[str]:
    if r.get("target") is None:
        return ["—"] * 3
    if r["target_steps"] is None:
        return ["not reached"] * 3
    return [_fmt(r["target_steps"], ".0f"), _fmt(r["target_samples"], ",.0f"), _fmt(r["target_mib"], ",.1f")]


def _pm(value, spec: str) -> str:
    return "—" if value is None else f"± {format(value, spec)}"


def _pct(value) -> str:
    return "—" if value is None else f"{value * 100:+.1f}%"


def _header(info: dict, *, command: str) -> list[str]:
    """The paragraphs above a table: how it was made, its convergence check, its costs to a target."""
    rows, kind = info["rows"], info["kind"]
    return [
        f"Generated by `{command}` from run dirs (summary.json, metrics.jsonl). One row per variant x "
        "coverage C x protocol; runs that differ only in their seed are averaged "
        "(± one standard deviation over the *runs* column's runs; *95% CI*: the half-width of the mean's 95% "
        "confidence interval, Student's t over those runs, t(0.975, n - 1) · sd / √n); *lr*: the row's peak "
        "learning rate. Memory is the busiest rank's: the live-tensor peak of a steady-state step and the static "
        "weights + gradients + optimizer state; *vs DDP* is the change against this table's DDP row. "
        f"Runs that did not complete: {info['incomplete']}.",
        "",
        f"Convergence check: {info.get('convergence') or 'no DDP row'}. *converged*: every run of the row passed "
        "its gate (the smoothed eval metric moved by less than trainer.plateau_threshold over the last 20% of the "
        "steps); the claims give no verdict on a row that did not.",
        "",
        f"Costs to a target ({_target_words(rows, kind)}): the steps, {'samples' if kind == 'image' else 'tokens'} "
        "and MiB one worker sent until every run of the row first evaluated at or past it (means over the runs; "
        "'not reached' when a run never did; resolved to trainer.eval_every).",
    ]


def markdown(table: str, info: dict, *, command: str, notes: list[str] = ()) -> str:
    """`<table>.md`: what the table is, its checks (and `notes`: what made it, e.g. its measured
    budget and learning-rate grid), then one line per row."""
    rows, kind = info["rows"], info["kind"]
    quality = ["eval acc", "95% CI"] if kind == "image" else ["eval loss", "95% CI", "ppl"]
    unit = "samples/s" if kind == "image" else "tokens/s"
    head = ["variant", "C", "protocol", "steps", "runs", "lr", "converged", *quality]
    head += ["peak GiB/rank", "vs DDP", "static GiB/rank", "vs DDP", "CUDA peak GiB", f"{unit}/rank"]
    head += ["comm MiB/step", "step s", "steps to target", f"{'samples' if kind == 'image' else 'tokens'} to target"]
    head += ["MiB sent to target"]
    lines = [f"# {table}", "", *_header(info, command=command), ""]
    lines += [line for note in notes for line in (note, "")]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if kind == "image":
            pct = [None if v is None else 100 * v for v in (r["eval_acc"], r["eval_acc_std"], r["eval_acc_ci95"])]
            q = [_fmt(pct[0], ".2f", pct[1]), _pm(pct[2], ".2f")]
        else:
            q = [_fmt(r["eval_loss"], ".4f", r["eval_loss_std"]), _pm(r["eval_loss_ci95"], ".4f")]
            q.append(_fmt(r.get("eval_ppl"), ".2f"))
        cells = [
            r["variant"],
            f"{r['coverage']:g}",
            r["protocol"],
            str(r["steps"]),
            str(r["runs"]),
            _fmt(r.get("lr"), ".3g"),
            "yes" if r["converged"] else "**no**",
            *q,
            _fmt(r["peak_gib"], ".4f"),
            _pct(r["peak_gib_vs_ddp"]),
            _fmt(r["static_gib"], ".4f"),
            _pct(r["static_gib_vs_ddp"]),
            _fmt(r["cuda_peak_gib"], ".2f"),
            _fmt(r["throughput_per_rank"], ".0f"),
            _fmt(r["comm_mib_per_step"], ".2f"),
            _fmt(r["step_time_s"], ".3f"),
            *_to_target(r),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


CSV_KEYS = [
    "variant",
    "coverage",
    "protocol",
    "steps",
    "runs",
    "lr",
    "converged",
    "eval_acc",
    "eval_acc_std",
    "eval_loss",
    "eval_loss_std",
    "eval_acc_ci95",
    "eval_loss_ci95",
    "eval_ppl",
    "peak_gib",
    "peak_gib_vs_ddp",
    "static_gib",
    "static_gib_vs_ddp",
    "cuda_peak_gib",
    "cuda_peak_gib_vs_ddp",
    "throughput_per_rank",
    "comm_mib_per_step",
    "step_time_s",
    "target",
    "target_steps",
    "target_samples",
    "target_mib",
    # What the row ran (`pilot_columns`).
    "model",
    "kind",
    "inner_width",
    "world_size",
    "global_batch",
    "seq_len",
    "precision",
    "masking",
    "granularity",
    "outer",
    "sync_every",
    "spectral_gap",  # the mask's rho (`spectral_gap`: mask.json)
]


def _series(r: dict) -> str:
    """A plot series: the variant, and its protocol unless it is the default."""
    return r["variant"] if r["protocol"] == "same_iteration" else f"{r['variant']} ({r['protocol']})"


def _label(r: dict) -> str:
    return _series(r) if r["variant"] == "DDP" else f"{_series(r)} C={r['coverage']:g}"


def plots(table: str, info: dict, out: Path) -> list[Path]:
    """Training loss per row, peak memory per row, quality against coverage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, kind = info["rows"], info["kind"]
    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        records = read_json_lines(Path(r["run_dirs"][0]) / METRICS)
        points = [(x["step"], x["train_loss"]) for x in records if "train_loss" in x]
        if points:
            ax.plot(*zip(*points, strict=True), label=_label(r), lw=1.2)
    ax.set(xlabel="step", ylabel="train loss (first seed)", title=f"{table}: training loss")
    ax.legend(fontsize=7)
    written.append(_save(fig, out / f"{table}_loss.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = [_label(r) for r in rows]
    ax.barh(labels, [r["peak_gib"] or 0 for r in rows], color="tab:blue", label="live peak")
    ax.barh(labels, [r["static_gib"] or 0 for r in rows], color="tab:orange", label="static")
    ax.set(xlabel="GiB (2**30 bytes) per rank (busiest rank)", title=f"{table}: memory per rank")
    ax.invert_yaxis()
    ax.legend(fontsize=7)
    written.append(_save(fig, out / f"{table}_memory.png"))

    fig, ax = plt.subplots(figsize=(6, 4.5))
    _quality(ax, rows, kind)
    ax.set_title(f"{table}: quality against coverage")
    written.append(_save(fig, out / f"{table}_quality.png"))
    written.append(_curves(table, rows, kind, out, plt))
    return written


def _curves(table: str, rows: list[dict], kind: str, out: Path, plt) -> Path:
    """Eval quality against steps, samples (or tokens) and MiB sent per worker, a line per row
    (mean over its runs), DDP's target as a dotted line."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    unit = "samples" if kind == "image" else "tokens"
    for r in rows:
        c = curve(r, kind)
        for ax, x in zip(axes, (c["steps"], c["samples"], c["mib"]), strict=True):
            if x and c["values"]:
                ax.plot(x, c["values"], marker=".", lw=1.2, label=_label(r))
    target = next((r["target"] for r in rows if r.get("target") is not None), None)
    for ax, xlabel in zip(axes, ("step", unit, "MiB sent per worker"), strict=True):
        if target is not None:
            ax.axhline(target, color="black", ls=":", lw=1, label="target (99% of DDP)")
        ax.set(xlabel=xlabel)
    axes[0].set(ylabel="eval accuracy" if kind == "image" else "eval loss")
    axes[2].legend(fontsize=7)
    fig.suptitle(f"{table}: quality against steps, {unit} and bytes sent (mean over seeds)")
    return _save(fig, out / f"{table}_curves.png")


def _quality(ax, rows: list[dict], kind: str) -> None:
    """Eval quality against coverage, a line per series, with ± the standard deviation over
    seeds as error bars (DDP: a dashed line and a shaded band)."""
    metric, name = ("eval_acc", "eval accuracy") if kind == "image" else ("eval_loss", "eval loss")
    names = sorted({_series(r) for r in rows if r["variant"] != "DDP"})
    for i, series in enumerate(names):
        pts = sorted(
            (r["coverage"], r[metric], r.get(f"{metric}_std") or 0.0)
            for r in rows
            if _series(r) == series and r[metric] is not None
        )
        if pts:
            x, y, err = zip(*pts, strict=True)
            x = [c + 0.004 * (i - (len(names) - 1) / 2) for c in x]  # the series side by side at one C
            marker = "s" if series.endswith(")") else "o"
            ls = "-" if len(pts) > 1 else "none"
            ax.errorbar(x, y, yerr=err, marker=marker, ls=ls, capsize=3, label=series)
    ddp = next((r for r in rows if r["variant"] == "DDP" and r[metric] is not None), None)
    if ddp:
        ax.axhline(ddp[metric], color="black", ls="--", lw=1, label="DDP")
        std = ddp.get(f"{metric}_std") or 0.0
        if std:
            ax.axhspan(ddp[metric] - std, ddp[metric] + std, color="black", alpha=0.08, lw=0)
    suffix = " (mean ± std over seeds)" if any(r.get(f"{metric}_std") for r in rows) else ""
    ax.set(xlabel="coverage C", ylabel=name + suffix)
    ax.legend(fontsize=7)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def collect(
    roots: list[Path],
    out: Path,
    *,
    command: str,
    make_plots: bool = True,
    claims: bool = False,
    memory_table: Path | None = None,
    cuda: tuple[Path, ...] = (),
    wandb_project: str | None = None,
    wandb_mode: str = "offline",
    notes: dict[str, list[str]] | None = None,
) -> list[Path]:
    """Write every table (and its plots) found under `roots` into `out` (`notes`: paragraphs for a
    table's header, by table name), and with `claims`
    out/claims.md (the memory claims also read `memory_table` and `cuda`, where given); with
    `wandb_project`, log them all to one W&B run of their own (`log_to_wandb`). Returns the
    files written."""
    tables = build_rows(find_runs(roots))  # everything is read before anything is written
    metrics = {Path(d) / METRICS for info in tables.values() for row in info["rows"] for d in row["run_dirs"]}
    for path in sorted(p for p in metrics if p.is_file()):
        read_json_lines(path)  # a damaged line is refused now, not halfway through the plots
    if not tables:
        raise ConfigError("roots", " ".join(map(str, roots)), "hold no completed run (a run dir with summary.json)")
    memory = []
    if claims:
        memory = points_from_tables(tables, "run dirs (live-tensor peak)")
        memory += _read(points_from_memory_table, memory_table) if memory_table else []
        memory += [p for path in cuda for p in _read(lambda q: points_from_cuda([q]), path)]
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for table, info in sorted(tables.items()):
        md = out / f"{table}.md"
        md.write_text(markdown(table, info, command=command, notes=(notes or {}).get(table, ())))
        with (out / f"{table}.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_KEYS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(info["rows"])
        written += [md, out / f"{table}.csv"]
        if make_plots:
            written += plots(table, info, out)
    if claims:
        path = out / CLAIMS_FILE
        path.write_text(claims_markdown(tables, memory, command=command))
        written.append(path)
    if wandb_project:
        log_to_wandb(tables, written, out=out, project=wandb_project, mode=wandb_mode, command=command)
    return written


def _read(reader, path: Path) -> list:
    """A measurement file read by `reader`; DamagedFile when it is not what it should be."""
    try:
        return reader(path)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise DamagedFile(path, f"cannot be read ({describe(err)})") from None


def log_to_wandb(tables: dict, written: list[Path], *, out: Path, project: str, mode: str, command: str) -> None:
    """One W&B run (job_type `tables`, its files under OUT/wandb): every table as a wandb.Table
    under `<table>/rows`, every plot as an image under `<table>/<plot>`, and the claims'
    comparisons as the table `claims` (one row per comparison, with its verdict)."""
    import wandb  # W&B costs seconds to import: only for --wandb

    run = wandb.init(
        project=project,
        job_type="tables",
        name="sdp.collect",
        mode=mode,
        dir=str(out),
        config={"command": command},
        settings=wandb.Settings(quiet=True),
    )
    try:
        record = {}
        for table, info in sorted(tables.items()):
            record[f"{table}/rows"] = wandb.Table(
                columns=CSV_KEYS, data=[[r.get(k) for k in CSV_KEYS] for r in info["rows"]]
            )
        for path in written:
            table, _, plot = path.stem.rpartition("_")
            if path.suffix == ".png":
                record[f"{table}/{plot}"] = wandb.Image(str(path))
        record["claims"] = wandb.Table(columns=CLAIM_COLUMNS, data=claim_rows(tables))
        run.log(record, step=0)
    finally:
        run.finish()


CLAIM_COLUMNS = ["claim", "table", "row", "against", "d", "se", "runs", "verdict"]


def claim_rows(tables: dict) -> list[list]:
    return [
        [claim.number, c.table, c.first, c.second, c.d, c.se if math.isfinite(c.se) else None, min(c.runs), c.verdict]
        for claim in quality_claims(tables)
        for c in claim.comparisons
    ]
