"""What each row of a table paid to reach a quality: the steps, the samples (or tokens) and the
bytes one worker sent until its eval metric first reached 99% of DDP's final quality; and its
eval curve against each of the three (`curve`, the tables' `_curves.png`).

The target is 99% of the DDP row's final eval accuracy (image tables), or an eval loss within
1% of DDP's final one, DDP's / 0.99 (text tables). A run reaches it at its first evaluation at
or past the target (evaluations are every `trainer.eval_every` steps, so the step is that
resolution's); a row reaches it when every one of its runs does, and its costs are their means.
Samples are the steps times the global batch, tokens that times `dataset.seq_len`; the bytes are
the steps times the busiest rank's mean bytes sent per step (for an outer loop, the window's
mean: its syncs spread over H steps).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from sdp.metrics.convergence import gate_metric
from sdp.paths import read_yaml_mapping
from sdp.rundir import CONFIG, Summary, evaluations

TARGET = 0.99
MIB = 2**20


def target_value(ddp_final: float, kind: str) -> float:
    """The quality to reach: 99% of DDP's final accuracy, or its final loss / 0.99."""
    return TARGET * ddp_final if kind == "image" else ddp_final / TARGET


def first_reached(evals: list[tuple[int, float]], target: float, kind: str) -> int | None:
    """The first evaluated step at or past `target` (accuracy up to it, loss down to it)."""
    for step, value in evals:
        if (value >= target) if kind == "image" else (value <= target):
            return step
    return None


def batch_of(run_dir: Path, kind: str) -> int | None:
    """Samples (image) or tokens (text) a step, from the run's config.yaml; None if it lacks them."""
    path = Path(run_dir) / CONFIG
    config = read_yaml_mapping(path) if path.is_file() else {}
    batch = config.get("trainer", {}).get("global_batch_size")
    if batch is None or kind == "image":
        return batch
    seq_len = config.get("dataset", {}).get("seq_len")
    return None if seq_len is None else batch * seq_len


def costs_to_target(members: list[tuple[Path, Summary]], target: float | None, kind: str) -> dict:
    """A row's costs to `target` (None: the table has no DDP result): the mean steps, samples or
    tokens and MiB sent per worker over its runs, each None when a run did not reach it."""
    out = {"target": target, "target_steps": None, "target_samples": None, "target_mib": None}
    if target is None:
        return out
    metric = gate_metric(kind)
    steps, samples, mib = [], [], []
    for run_dir, s in members:
        step = first_reached(evaluations(run_dir, metric), target, kind)
        if step is None:
            return out
        batch = batch_of(run_dir, kind)
        per_rank = s.comm_bytes_per_step_per_rank or [s.comm_bytes_per_step or 0.0]
        steps.append(step)
        samples.append(None if batch is None else step * batch)
        mib.append(step * max(per_rank) / MIB)
    out["target_steps"], out["target_mib"] = statistics.fmean(steps), statistics.fmean(mib)
    out["target_samples"] = None if None in samples else statistics.fmean(samples)
    return out


def curve(row: dict, kind: str) -> dict:
    """A row's eval metric against steps, samples (or tokens) and MiB sent per worker: the mean
    over its runs at the steps every run evaluated; samples from its first run's batch (None
    when its config lacks it), MiB from the row's busiest-rank bytes a step."""
    metric = gate_metric(kind)
    per_run = [dict(evaluations(Path(d), metric)) for d in row["run_dirs"]]
    steps = sorted(set.intersection(*(set(e) for e in per_run))) if per_run else []
    batch = batch_of(Path(row["run_dirs"][0]), kind) if row["run_dirs"] else None
    return {
        "steps": steps,
        "values": [statistics.fmean(e[s] for e in per_run) for s in steps],
        "samples": None if batch is None else [s * batch for s in steps],
        "mib": [s * (row.get("comm_mib_per_step") or 0.0) for s in steps],
    }
