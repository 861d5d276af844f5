"""Faults in real multi-process runs (tests/faults.py arms them): a rank killed under
torchrun --max-restarts, a hung rank, a full disk during a checkpoint, a damaged newest
checkpoint, a NaN loss (stop, then resume skipping it). Each must end where an uninterrupted
run ends."""

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import job_env, launch, read_run
from ranks import run_ranks

from sdp.launching.variants import torchrun_command
from sdp.run.checkpoint import complete_checkpoints

pytestmark = pytest.mark.dist

FAULTS = Path(__file__).parent / "faults.py"
# N-SDP forward with a new mask every 3 steps: every rank's checkpoint file differs, and
# a resume must rebuild the right mask epoch.
RUN = [
    "model=llama_tiny",
    "dataset=synthetic_text",
    "dataset.seq_len=32",
    "trainer.global_batch_size=16",
    "logger=none",
    "trainer.max_steps=8",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "dataset.eval_batches=1",
    "trainer.checkpoint_every=2",
    "masking=forward",
    "masking.coverage=0.5",
    "masking.resample_every=3",
]
TIMINGS = ("tokens_or_samples_per_s", "step_time_s")


def with_fault(fault: str, overrides: list[str], *, cwd: Path, restarts: int = 0) -> subprocess.CompletedProcess:
    """The entrypoint with `fault` armed on 2 ranks: under torchrun when restarts are asked
    for (they are what is tested), on forked ranks otherwise."""
    if restarts == 0:
        return run_ranks("faults:main", [fault, *overrides], nproc=2, cwd=cwd, env=job_env())
    cmd = torchrun_command(2, f"--max-restarts={restarts}", str(FAULTS), fault, *overrides)
    return subprocess.run(cmd, cwd=cwd, env=job_env(), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = launch([*RUN, f"run_dir={run_dir}"], cwd=run_dir.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def assert_same_run(run_dir: Path, reference: Path) -> None:
    """Bitwise the same final parameters and every logged loss."""
    a, b = (torch.load(d / "model.pt", weights_only=True) for d in (reference, run_dir))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    (_, ra), (_, rb) = read_run(reference), read_run(run_dir)
    assert [{k: v for k, v in r.items() if k not in TIMINGS} for r in ra] == [
        {k: v for k, v in r.items() if k not in TIMINGS} for r in rb
    ]


def test_a_killed_rank_restarts_from_the_latest_checkpoint(tmp_path, reference):
    # Rank 1 dies (SIGKILL) right after step 5; torchrun restarts both ranks. No run_dir is
    # given: the restart finds the run dir its first attempt made by the job's rendezvous id.
    out = tmp_path / "outputs"
    proc = with_fault("kill:1:5", [*RUN, f"output_root={out}"], cwd=tmp_path, restarts=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exitcode: -9" in proc.stderr  # the first attempt did lose a rank to SIGKILL
    (run_dir,) = out.iterdir()
    summary, _ = read_run(run_dir)
    assert summary["status"] == "completed" and summary["resumed_from"] == 4  # 1 step lost, interval 2
    assert_same_run(run_dir, reference)


def stamped_stderr(cmd: list[str], *, cwd: Path, until: str, limit_s: float) -> tuple[list[tuple[float, str]], int]:
    """Launch `cmd` in a session of its own and collect its stderr lines with the time each
    arrived, until a line starts with `until` (or `limit_s` passes); then kill torchrun's
    session (its workers have sessions of their own: the caller kills a stopped one) and
    return the lines and the exit code."""
    pipes = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE}
    proc = subprocess.Popen(cmd, cwd=cwd, env=job_env(), text=True, start_new_session=True, **pipes)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.time(), line) for line in proc.stderr), daemon=True)
    reader.start()
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None and not any(x.startswith(until) for _, x in lines):
        time.sleep(0.2)
    time.sleep(1.0)  # what follows the line (torchrun's report of the exits)
    os.killpg(proc.pid, signal.SIGKILL)
    rc = proc.wait()
    reader.join(timeout=10)
    return lines, rc


TIMEOUT_S = 10  # the hung-rank test waits it out: long enough for any healthy collective here


def test_a_hung_rank_ends_the_job_with_one_error_and_a_resumable_checkpoint(tmp_path, reference):
    # Rank 1 stops (SIGSTOP) right after step 5: rank 0 waits in the next collective for
    # parallelism.timeout_s, then exits with one line; the checkpoint of step 4 resumes.
    run_dir = tmp_path / "run"
    cmd = torchrun_command(2, str(FAULTS), "stop:1:5", *RUN, f"run_dir={run_dir}", f"parallelism.timeout_s={TIMEOUT_S}")
    record = tmp_path / "stopped_at"
    try:
        lines, _ = stamped_stderr(cmd, cwd=tmp_path, until="error: ", limit_s=180)
    finally:
        if record.exists():  # the stopped rank is in a session of its own: kill it by its pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(record.read_text().split()[1]), signal.SIGKILL)
    stopped = float(record.read_text().split()[0])
    ours = [(t, line.strip()) for t, line in lines if line.startswith("error: ")]
    assert len(ours) == 1, "".join(line for _, line in lines)[-3000:]
    (at, error), text = ours[0], "".join(line for _, line in lines)
    assert "Traceback" not in text
    # torchrun closes the job when it sees a worker fail: rank 0 had exited, within the bound.
    exited = [t for t, line in lines if "closing signal SIGTERM" in line]
    assert exited and exited[0] - stopped < TIMEOUT_S + 15, text[-3000:]
    prefix = f"error: rank 1 stopped responding: rank 0 got no reply within parallelism.timeout_s={TIMEOUT_S} in "
    assert error.startswith(prefix), error
    assert "; the last checkpoint, step 4, is kept: the same command resumes from it" in error, error
    assert at - stopped >= TIMEOUT_S  # it waited for the timeout, no less
    summary, records = read_run(run_dir)
    assert summary["status"] == "failed" and f"error: {summary['error']}" == error
    assert [c.step for c in complete_checkpoints(run_dir)][-1] == 4
    # The same command (no fault) resumes from step 4 and ends where the uninterrupted run ends.
    proc = launch([*RUN, f"run_dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary, _ = read_run(run_dir)
    assert summary["status"] == "completed" and summary["resumed_from"] == 4
    assert_same_run(run_dir, reference)


def test_a_full_disk_and_a_damaged_checkpoint_lose_nothing(tmp_path, reference):
    run_dir = tmp_path / "run"
    # Launch 1: rank 1's part of the checkpoint of step 4 hits a full disk; the run goes on
    # and stops after step 6 with a checkpoint, as a preemption would.
    proc = with_fault("enospc:1:4", [*RUN, f"run_dir={run_dir}", "trainer.stop_at_step=6"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: checkpoint")]
    assert len(warnings) == 1 and "step 4 not written (rank 1: " in warnings[0], proc.stderr[-2000:]
    assert "step_00000004.partial/rank00001.pt: no space left on device, " in warnings[0]
    assert "kept step_00000002" in warnings[0]
    summary, _ = read_run(run_dir)
    assert summary["status"] == "stopped" and summary["checkpoint_failures"] == 1
    assert [c.step for c in complete_checkpoints(run_dir)] == [2, 6]
    assert not list((run_dir / "checkpoints").glob("*.partial"))
    # Bit rot in the newest checkpoint: one byte of rank 1's file.
    damaged = run_dir / "checkpoints" / "step_00000006" / "rank00001.pt"
    raw = bytearray(damaged.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    damaged.write_bytes(bytes(raw))
    # Launch 2, the same command: resumes from step 2, with a warning, and ends as the reference.
    proc = launch([*RUN, f"run_dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "warning: damaged checkpoint skipped: step_00000006/rank00001.pt does not match its SHA-256 checksum"
        in proc.stderr
    )
    assert "warning: resuming from step_00000002, the newest intact checkpoint" in proc.stderr
    summary, _ = read_run(run_dir)
    assert summary["status"] == "completed" and summary["resumed_from"] == 2
    assert_same_run(run_dir, reference)


def test_a_nan_stops_the_run_and_a_resume_can_skip_it(tmp_path):
    run_dir = tmp_path / "run"
    # Rank 1's loss is NaN in step 3: every rank stops before the update, after a diagnostic.
    proc = with_fault("nan:1:3", [*RUN, f"run_dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and "[rank" not in proc.stderr  # one line, no traceback
    assert "the last checkpoint, step 2, is kept: resume it with trainer.on_nonfinite=skip" in ours[0]
    summary, records = read_run(run_dir)
    assert summary["status"] == "failed"
    # Rank 1's loss, then the NaN gradients the all-reduce spread to every rank.
    assert "step 3: non-finite loss or gradient (rank 0: loss 8." in summary["error"]
    assert "rank 1: loss nan, non-finite gradients in model.embed_tokens.weight" in summary["error"]
    diagnostic = json.loads((run_dir / "nonfinite_step_3.json").read_text())
    assert [r["nonfinite_loss"] for r in diagnostic["ranks"]] == [False, True]
    assert all(r["nonfinite_grads"] for r in diagnostic["ranks"])  # NaN gradients reached both ranks
    assert [c.step for c in complete_checkpoints(run_dir)] == [2]  # the last good one
    assert max(r["step"] for r in records) == 2
    # Resume with the step skipped (the NaN is in this launch's first step, step 3).
    proc = with_fault("nan:1:1", [*RUN, f"run_dir={run_dir}", "trainer.on_nonfinite=skip"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning: step 3 skipped (1 of at most 10): non-finite loss or gradient (rank 0: loss 8." in proc.stderr
    summary, records = read_run(run_dir)
    assert summary["status"] == "completed" and summary["nonfinite_skipped_steps"] == [3]
    assert {"step": 3, "nonfinite_skipped": 1} in records
    assert all(r["train_loss"] == r["train_loss"] for r in records if "train_loss" in r)  # no NaN logged


def test_a_nan_under_a_fused_optimizer_is_found_at_the_next_log_step_and_never_applied(tmp_path):
    # The device decides (found_inf) and the host reads the verdict at log steps only: rank 1's
    # loss is NaN in step 3, read at step 4. Updates 3 and 4 were skipped, so the run stops as the
    # host check would have, with step 2's checkpoint kept and nothing logged after it.
    run_dir = tmp_path / "run"
    fused = ["optim.implementation=fused", "trainer.log_every=4"]
    proc = with_fault("nan:1:3", [*RUN, f"run_dir={run_dir}", *fused], cwd=tmp_path)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and "[rank" not in proc.stderr  # one line, no traceback
    assert "step 3: non-finite loss or gradient (rank 0: loss 8." in ours[0]
    assert "rank 1: loss nan, non-finite gradients in model.embed_tokens.weight" in ours[0]
    assert "(found at step 4: the updates of steps 3-4 were skipped)" in ours[0]
    assert "the last checkpoint, step 2, is kept" in ours[0]
    diagnostic = json.loads((run_dir / "nonfinite_step_3.json").read_text())
    assert [r["nonfinite_loss"] for r in diagnostic["ranks"]] == [False, True]
    assert all(r["nonfinite_grads"] for r in diagnostic["ranks"])
    assert [c.step for c in complete_checkpoints(run_dir)] == [2]
    summary, records = read_run(run_dir)
    assert summary["status"] == "failed"
    assert all(r["step"] <= 2 for r in records)


@contextlib.contextmanager
def small_disk(path: Path, size_mib: int):
    """A tmpfs of `size_mib` at `path`: a real full disk (torch.save then fails as it does on
    one, with its zip writer's RuntimeError). Needs root, as this machine and CI have."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


# The tiny LLaMA's model.pt and hf/model.safetensors are 7.1 MB each, a checkpoint (Adam's
# state too) 21 MB: on 12 MiB the checkpoint and the export cannot be written, model.pt can.
FULL_DISK_RUN = [*RUN[:5], "trainer.max_steps=4", *RUN[6:9], "trainer.checkpoint_every=2", "masking=none"]


def test_a_full_disk_at_the_end_keeps_a_finished_run_whole(tmp_path):
    from sdp.analysis.tables import build_rows, find_runs
    from sdp.export import main as export_main

    with small_disk(tmp_path / "disk", 12) as disk:
        run_dir = disk / "run"
        proc = launch([*FULL_DISK_RUN, f"run_dir={run_dir}"], nproc=1, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
        part = run_dir / "checkpoints" / "step_00000002.partial" / "rank00000.pt"
        assert warnings[0].startswith(
            f"warning: checkpoint of step 2 not written (rank 0: {part}: no space left on device"
        )
        assert warnings[1].startswith(f"warning: the export was not written ({run_dir / 'hf'}: no space left on device")
        assert warnings[1].endswith(
            f"the run is complete and its model.pt whole: python -m sdp.export {run_dir} writes it"
        )
        assert len(warnings) == 2 and "Traceback" not in proc.stderr
        summary, _ = read_run(run_dir)
        assert summary["status"] == "completed" and summary["steps"] == 4 and summary["export"] == []
        assert summary["export_error"].startswith(f"{run_dir / 'hf'}: no space left on device")
        assert not (run_dir / "hf").exists() and (run_dir / "model.pt").is_file()  # nothing half-written
        assert [t["rows"][0]["runs"] for t in build_rows(find_runs([disk])).values()] == [1]  # collect has it
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)  # space again
        assert export_main([str(run_dir)]) == 0
        assert (run_dir / "hf" / "model.safetensors").is_file()


def test_a_final_model_that_cannot_be_written_is_one_line(tmp_path):
    with small_disk(tmp_path / "disk", 6) as disk:  # model.pt (7.1 MB) does not fit
        run_dir = disk / "run"
        proc = launch([*FULL_DISK_RUN, "trainer.checkpoint_every=0", f"run_dir={run_dir}"], nproc=1, cwd=tmp_path)
        assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert line.startswith(
            f"error: the final model was not written: {run_dir / 'model.pt'}: no space left on device"
        )
        assert line.endswith("; no checkpoint was kept: free space, then start it again in a new run_dir")
        summary, _ = read_run(run_dir)
        assert summary["status"] == "failed" and summary["error"] == line.removeprefix("error: ")
        assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "metrics.jsonl", "summary.json"]
