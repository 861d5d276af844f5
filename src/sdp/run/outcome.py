"""How a run ends, in files and in one line: summary.json, the export, the diagnosis of a lost
peer or a full disk, and the result printed on the terminal."""

from __future__ import annotations

import sys
from pathlib import Path

from sdp import dist, rundir
from sdp.errors import PeerLost, WriteFailed
from sdp.run.checkpoint import complete_checkpoints
from sdp.run.config import RunConfig
from sdp.rundir import Summary, write_error
from sdp.rundir.hf import EXPORT_DIR, export_run_dir, exported_files


def write_failure(err: BaseException, *, run_dir: str | None) -> WriteFailed | None:
    """A run dir file that could not be written (model.pt, or any write on a full disk) as one
    line with what the same command then does; None for any other error."""
    if not (isinstance(err, WriteFailed) or rundir.disk_full(err)) or run_dir is None:
        return None
    line = str(err) if isinstance(err, WriteFailed) else write_error(err, Path(err.filename or run_dir))
    found = complete_checkpoints(Path(run_dir))
    then = (
        f"free space, then the same command resumes from step {found[-1].step}"
        if found
        else "no checkpoint was kept: free space, then start it again in a new run_dir"
    )
    return WriteFailed(f"{line}; {then}")


def save_summary(run_dir: Path, summary: Summary) -> None:
    """summary.json, or one line saying why it could not be written (the run's outcome stands)."""
    try:
        rundir.write_summary(run_dir, summary)
    except OSError as err:
        print(f"error: summary.json not written: {write_error(err, run_dir / rundir.SUMMARY)}", file=sys.stderr)


def export_model(cfg: RunConfig, run_dir: Path, summary: Summary) -> None:
    """Rank 0: RUN_DIR/hf/ from model.pt. A failed export (a full disk) does not fail a run
    whose training finished and whose model.pt is whole: hf/ is removed rather than left
    half-written, one warning line names the path, and `python -m sdp.export RUN_DIR` writes it
    later; `summary.export_error` keeps the reason."""
    try:
        export_run_dir(run_dir, cfg.model, cfg.dataset)
    except Exception as err:  # noqa: BLE001 - reported in one line; the run itself is complete
        summary.export_error = write_error(err, run_dir / EXPORT_DIR)
        print(
            f"warning: the export was not written ({summary.export_error}); the run is complete and its "
            f"model.pt whole: python -m sdp.export {run_dir} writes it",
            file=sys.stderr,
            flush=True,
        )
        return
    summary.export = exported_files(run_dir)


# How long the ranks whose collective failed wait for each other's reports (a hung rank sends none).
ROLL_CALL_S = 5.0


def peer_lost(collective: str, err: BaseException, *, world: dist.World, timeout_s: float, run_dir) -> PeerLost:
    """The one-line diagnosis of a collective that timed out or lost a peer: which collective,
    which ranks did not report the failure too (the hung ones, as far as the job's store
    knows), and the checkpoint a restart resumes from. The lowest rank that reports it is the
    one that prints it and writes summary.json."""
    reported = dist.roll_call(world, wait_s=ROLL_CALL_S)
    silent = [r for r in range(world.world_size) if reported is not None and r not in reported]
    if silent:
        who = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped responding"
    else:
        who = "a rank stopped responding or left the job"
    timed_out = "time" in str(err).lower()
    cause = f"got no reply within parallelism.timeout_s={timeout_s:g}" if timed_out else "lost its connection to a peer"
    found = complete_checkpoints(Path(run_dir)) if run_dir else []
    kept = (
        f"the last checkpoint, step {found[-1].step}, is kept: the same command resumes from it, "
        "and so does torchrun --max-restarts"
        if found
        else "no checkpoint was written yet"
    )
    return PeerLost(
        f"{who}: rank {world.rank} {cause} in {collective}; {kept}",
        reporter=reported is None or reported[0] == world.rank,
    )


def resume_hint(step: int | None) -> str:
    return f"the same command resumes from step {step}" if step else "the same command starts it again"


def print_result(summary: Summary) -> None:
    """A short human-readable result line block for the terminal."""
    mem = summary.memory
    values = {"train_loss": summary.train_loss, "eval_loss": summary.eval_loss, "eval_acc": summary.eval_acc}
    quality = " ".join(f"{k}={v:.4f}" for k, v in values.items() if v is not None)
    speed = summary.tokens_or_samples_per_s
    speed = "" if speed is None else f"{speed:.1f} {summary.throughput_unit}, "
    peak = "" if mem["peak_bytes"] is None else f", live peak {mem['peak_bytes'] / 2**30:.4f} GiB/rank"
    verb = "done"
    if summary.stopped_at:
        by = "Ctrl-C" if summary.stopped_by == "SIGINT" else summary.stopped_by
        verb = f"stopped ({by}); {resume_hint(summary.resumes_from)}"
    print(
        f"{verb}: {summary.steps} steps, {quality}, {speed}"
        f"params+grads+optim {summary.static_bytes / 2**30:.4f} GiB/rank{peak}, "
        f"comm {summary.comm_bytes_per_step / 2**20:.2f} MiB/step -> {summary.run_dir}",
        flush=True,
    )
