"""The estimate against what a run measured: per rank and per category, with the ratio.

A finished run records, for every rank, the live-tensor tracker's peak over its profiled step
(`trainer.profile_step`), split into weights, gradients, optimizer state, activations and
temporaries, and on CUDA also the allocator's peak (`torch.cuda.max_memory_allocated`). The
estimator traces the same config for the same rank without a GPU. Which figure stands for the
measured total is said on every table: the allocator's peak on CUDA (what an out-of-memory error
is about), the tracker's on CPU (where no allocator keeps one). The categories are the tracker's
on both. Communicators (a NCCL communicator's buffers, `parallelism.comm_group_overhead_mb` a
process group) are estimated only: neither the tracker nor PyTorch's allocator sees them.

`python -m sdp.estimate --against RUN_DIR` prints this for a finished run;
`scripts/cuda_memory_check.py` writes the same table for the runs it measures on a GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sdp.errors import ConfigError
from sdp.metrics.memory import PEAK_KINDS
from sdp.paths import DamagedFile
from sdp.planning.fit import GIB
from sdp.run.config import RunConfig, run_config, validate
from sdp.rundir import CONFIG, read_summary, run_status

COMMUNICATORS = "communicators"
TOTAL = "total"
TRACKER = "live-tensor tracker"
ALLOCATOR = "CUDA allocator peak (torch.cuda.max_memory_allocated)"
LABELS = {
    "weights": "weights",
    "grads": "gradients",
    "optimizer": "optimizer state",
    "activations": "activations",
    "temporaries": "temporaries",
    COMMUNICATORS: "communicators",
    TOTAL: "total",
}


@dataclass(frozen=True)
class Figure:
    """One category of one rank: the estimate and the measurement in bytes (None: not had)."""

    category: str
    estimated: int | None
    measured: int | None

    @property
    def ratio(self) -> float | None:
        """estimated / measured; None where either is missing or nothing was measured."""
        if self.estimated is None or not self.measured:
            return None
        return self.estimated / self.measured


@dataclass(frozen=True)
class RankAgainst:
    """A rank's estimate against its measurement; `total_by` says what the measured total is."""

    rank: int
    total_by: str
    figures: tuple[Figure, ...]

    def figure(self, category: str) -> Figure:
        return next(f for f in self.figures if f.category == category)

    def as_dict(self) -> dict:
        return {
            "rank": self.rank,
            "total_by": self.total_by,
            "figures": [{**asdict(f), "ratio": f.ratio} for f in self.figures],
        }


def compare(rank: int, memory: dict, breakdown: dict, allocator_peak: int | None) -> RankAgainst:
    """One rank: the memory of the estimator's result for it (`sdp.planning.estimator.estimate`)
    against the tracker's `breakdown` of its measured step (the PEAK_KINDS and "total") and, on
    CUDA, the allocator's peak, which then stands for the measured total."""
    peak = memory["peak_breakdown"]
    figures = [Figure(kind, peak.get(kind), breakdown.get(kind)) for kind in PEAK_KINDS]
    figures.append(Figure(COMMUNICATORS, memory["comm_group_bytes"], None))
    # The allocator holds no communicator buffers either: both totals leave them out.
    measured = breakdown.get(TOTAL) if allocator_peak is None else allocator_peak
    total = Figure(TOTAL, memory["peak_bytes"], measured)
    return RankAgainst(rank, TRACKER if allocator_peak is None else ALLOCATOR, (*figures, total))


def finished_run(run_dir: Path) -> tuple[RunConfig, list[dict], str]:
    """A completed run's config (checked for its world size), its per-rank memory records and
    the device type it trained on (its optimizer is that device's: the estimate builds the same);
    one ConfigError naming `--against` for anything else."""
    if not (run_dir / CONFIG).is_file():
        raise ConfigError("--against", str(run_dir), f"has no {CONFIG}: not a run dir")
    summary = read_summary(run_dir)  # DamagedFile, naming it, when it cannot be read
    if summary is None or run_status(run_dir) != "completed":
        status = "no summary.json" if summary is None else f"status {summary.status}"
        raise ConfigError("--against", str(run_dir), f"is not a completed run ({status}): nothing was measured")
    ranks = summary.memory_per_rank or []
    if len(ranks) != summary.world_size or not all((r or {}).get("peak_breakdown") for r in ranks):
        raise ConfigError(
            "--against",
            str(run_dir),
            f"records the memory of {len(ranks)} of its {summary.world_size} ranks: a run of this "
            "version records every rank's (summary.json memory_per_rank)",
        )
    cfg = run_config(run_dir / CONFIG)
    try:
        validate(cfg, world_size=summary.world_size, offline=True, check_data=False)
    except ConfigError as err:
        raise DamagedFile(run_dir / CONFIG, f"holds a config this version refuses ({err})") from None
    return cfg, ranks, torch.device(summary.device).type


def measured_ranks(ranks: list[dict], wanted: str) -> list[int]:
    """The ranks `wanted` names: all, or one integer in range (ConfigError otherwise)."""
    if wanted == "all":
        return list(range(len(ranks)))
    if wanted.isdigit() and int(wanted) < len(ranks):
        return [int(wanted)]
    raise ConfigError("rank", wanted, f"allowed with --against: all, or an integer in [0, {len(ranks) - 1}]")


def format_against(rows: list[RankAgainst]) -> str:
    """Each rank's table in GiB (2**30 bytes): category, estimate, measured, their ratio."""
    out = []
    for row in rows:
        out.append(f"rank {row.rank}: estimate against measured (total measured by the {row.total_by})")
        out.append(f"  {'category':<16} {'estimate GiB':>13} {'measured GiB':>13} {'estimate/measured':>18}")
        for f in row.figures:
            out.append(
                f"  {LABELS[f.category]:<16} {_gib(f.estimated):>13} {_gib(f.measured, 'not seen'):>13} "
                f"{'' if f.ratio is None else f'{f.ratio:.4f}':>18}"
            )
    out.append(
        "GiB = 2**30 bytes. communicators: NCCL's buffers on a GPU (parallelism.comm_group_overhead_mb a process "
        "group), estimated only; the total leaves them out on both sides."
    )
    return "\n".join(out)


def _gib(nbytes: int | None, missing: str = "-") -> str:
    return missing if nbytes is None else f"{nbytes / GIB:.6f}"
