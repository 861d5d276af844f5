"""The run dir's file names, atomic JSON writes, the run dir's choice and torchrun's launch record."""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path

from sdp import dist
from sdp.paths import describe, read_json_lines

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
MODEL = "model.pt"
MASK = "mask.json"  # an SDP run's mask: every unit's holders (sdp.subnet.plan.SubnetPlan.record)
LAUNCH = "launch.json"
CHECKPOINTS = "checkpoints"


def write_text_atomic(path: Path, text: str) -> None:
    """Write through a temporary file, so a reader never sees half a file and a failed write (a
    full disk) leaves the old file as it was and no temporary one behind."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write JSON through a temporary file, so a reader never sees half a file."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


# A write that failed where less than this is free is put down to a full disk: torch.save reports
# one as a RuntimeError of its zip writer ("unexpected pos ..."), which carries no errno.
FULL_BELOW_BYTES = 64 << 20


def disk_full(err: BaseException) -> bool:
    """Whether `err` says the disk (or the quota) is full."""
    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


def write_error(err: BaseException, path: Path) -> str:
    """One line for a failed write of `path`: a full disk (or quota) said as such, with what is
    free, else the error's type and first line."""
    free = None
    try:
        free = shutil.disk_usage(next(p for p in (path, *path.parents) if p.exists())).free
    except (OSError, StopIteration):
        pass
    if disk_full(err) or (free is not None and free < FULL_BELOW_BYTES):
        left = "" if free is None else f", {free / 2**20:.1f} MiB free"
        return f"{path}: no space left on device{left}"
    return f"{path}: {describe(err)}"


def nonfinite_record(run_dir: Path, step: int) -> Path:
    """Where the diagnosis of a NaN/Inf step is written."""
    return run_dir / f"nonfinite_step_{step}.json"


def choose_run_dir(*, run_dir: str | None, output_root: str, name: str) -> Path:
    """The run dir: `run_dir` when given, else a new OUTPUT_ROOT/<time>-<name>. Decided by rank 0
    only (a timestamp differs between processes) and broadcast."""
    if run_dir:
        return Path(run_dir)
    base = Path(output_root) / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"
    candidate, n = base, 0
    while candidate.exists():  # two runs started in the same second
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def evaluations(run_dir: Path, metric: str = "eval_loss") -> list[tuple[int, float]]:
    """(step, value) of every evaluation of `metric` the run logged in its metrics file, in order."""
    path = Path(run_dir) / METRICS
    records = read_json_lines(path) if path.is_file() else []
    return [(r.get("step"), r[metric]) for r in records if r.get(metric) is not None]


def _step_of(line: str) -> float:
    """A metrics line's step; a line that is not a record (half written when a launch died) is
    dropped by a resume as a later one would be."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return float("inf")
    return step if isinstance(step, int) else float("inf")


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop metrics.jsonl records of steps after `step` (a resumed run writes them again)."""
    path = run_dir / METRICS
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if _step_of(line) <= step]
    write_text_atomic(path, "".join(line + "\n" for line in kept))


# ---------------------------------------------------------------- torchrun restarts (launch.json)


def record_launch(run_dir: Path) -> None:
    """Note the torchrun job that made `run_dir`, so a restart of it without run_dir finds it."""
    if dist.elastic_run_id():
        write_json_atomic(run_dir / LAUNCH, {"torchelastic_run_id": dist.elastic_run_id()})


def _restart_of() -> str | None:
    """The torchrun job's rendezvous id when this launch is one of its restarts, else None."""
    run_id = dist.elastic_run_id()
    return run_id if run_id and dist.restart_count() > 0 else None


def _launched_by(run_dir: Path) -> str | None:
    """The rendezvous id of the torchrun job that made `run_dir` (its launch.json), if any."""
    try:
        return json.loads((run_dir / LAUNCH).read_text()).get("torchelastic_run_id")
    except (OSError, ValueError):
        return None


def restarted_job(run_dir: Path) -> bool:
    """Whether this launch is a torchrun restart of the job that created `run_dir`."""
    run_id = _restart_of()
    return run_id is not None and _launched_by(run_dir) == run_id


def elastic_run_dir(output_root: str) -> str | None:
    """On a torchrun restart: the run dir under output_root that this job's first attempt made."""
    run_id, root = _restart_of(), Path(output_root)
    if run_id is None or not root.is_dir():
        return None
    return next((str(d) for d in sorted(root.iterdir(), reverse=True) if _launched_by(d) == run_id), None)
