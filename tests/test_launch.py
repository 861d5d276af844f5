"""The entrypoint as its own launcher (`python -m sdp.train --nproc-per-node=N`, sdp.launching.torchrun): bad
input is one line and exit code 2 before any worker starts; Ctrl-C stops every worker with a
checkpoint, one line, exit code 130, and summary.json keeps the steps."""

import json
import os
import signal
import subprocess
import time

import pytest
import torch
from conftest import job_env

from sdp.errors import ConfigError
from sdp.launching.torchrun import split_options, torchrun_argv, world_size
from sdp.launching.variants import train_command
from sdp.run.signals import StopSignals

TINY = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=32", "trainer.global_batch_size=8"]
TINY += ["logger=none", "trainer.progress=false", "trainer.eval_every=0", "dataset.eval_batches=1"]


def test_torchruns_options_are_taken_apart_from_the_overrides():
    argv = ["--nproc_per_node", "4", "--nnodes=2", "--standalone", "-m", "a=1", "--cfg", "job", "--max-restarts=1"]
    options, rest = split_options(argv)
    assert options == {"nproc-per-node": "4", "nnodes": "2", "standalone": "", "max-restarts": "1"}
    assert rest == ["-m", "a=1", "--cfg", "job"]
    assert world_size(options) == 8
    assert world_size({"nproc-per-node": "2", "nnodes": "3:3"}) == 6
    assert world_size({"nproc-per-node": "2", "nnodes": "1:4"}) is None  # elastic: the workers check it
    assert torchrun_argv({"nproc-per-node": "2"}, ["a=1"]) == [
        "--shutdown-timeout=120",
        "--nproc-per-node=2",
        "--standalone",
        "--module",
        "sdp.train",
        "a=1",
    ]
    multi = torchrun_argv({"nproc-per-node": "8", "nnodes": "2", "rdzv-endpoint": "h:29400"}, [])
    assert "--standalone" not in multi


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--nproc-per-node=0"], "--nproc-per-node='0': must be a whole number >= 1"),
        (["--nproc-per-node=many"], "--nproc-per-node='many': must be a whole number >= 1, or gpu/auto/cpu"),
        (["--nnodes=3:2"], "--nnodes='3:2': must be a number of nodes N >= 1, or a range MIN:MAX"),
        (["--max-restarts=-1"], "--max-restarts='-1': must be a whole number >= 0"),
        (["--nproc-per-node"], "--nproc-per-node=None: needs a value"),
    ],
)
def test_bad_launcher_options_are_one_line(argv, error):
    with pytest.raises(ConfigError) as info:
        world_size(split_options(argv)[0])
    assert str(info.value).startswith(error)


def test_a_sweep_or_a_worker_refuses_launcher_options(capsys):
    from sdp.train import main

    assert main(["-m", "--nproc-per-node=2", *TINY]) == 2
    assert capsys.readouterr().err == "error: --nproc-per-node='2': a sweep takes sweep.nproc=N\n"


def test_ctrl_c_asks_once_and_stops_at_once_the_second_time(tmp_path):
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    for launched in (False, True):
        signals = StopSignals(torch.device("cpu"), launched=launched, repeat_s=0.3)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            assert signals.reason == "SIGINT"
            if launched:  # the agent's copy of the same Ctrl-C, at once: ignored
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.35)
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.1)
        finally:
            signals.close()
    assert {sig: signal.getsignal(sig) for sig in previous} == previous


def _launch(argv: list[str], cwd) -> subprocess.Popen:
    # Its own session, so that a signal to its process group is what a terminal's Ctrl-C sends.
    cmd = train_command(2, *argv)
    return subprocess.Popen(
        cmd, cwd=cwd, env=job_env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_the_launcher_refuses_bad_input_before_any_worker_starts(tmp_path, monkeypatch, capsys):
    # The launcher's own process: the entrypoint's line and exit code 2 (under torchrun: that
    # line, then torchrun's ChildFailedError traceback, and exit code 1); nothing written.
    import sdp.launching.torchrun
    from sdp.train import main

    monkeypatch.setattr(sdp.launching.torchrun, "_run_agent", lambda argv: pytest.fail(f"workers started: {argv}"))
    argv = ["--nproc-per-node=2", *TINY, "masking=forward", "masking.coverage=0.3", f"run_dir={tmp_path / 'bad'}"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        "error: masking.coverage=0.3: gives C x K = 0.3 x 2 = 0.6 holders per unit, which must be a whole number "
        ">= 1; allowed with K=2 workers: 0.5, 1\n"
    )
    assert not (tmp_path / "bad").exists()


@pytest.mark.dist
def test_ctrl_c_stops_every_worker_with_a_checkpoint_in_one_line(tmp_path):
    # Ctrl-C after a few steps: every worker stops at the next log step with a checkpoint.
    run_dir = tmp_path / "run"
    argv = [*TINY, "trainer.max_steps=100000", "trainer.log_every=5", f"run_dir={run_dir}"]
    proc = _launch(argv, tmp_path)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    summary = json.loads((run_dir / "summary.json").read_text())
    step = summary["steps"]
    assert proc.returncode == 130 and err == "", err[-3000:]
    assert out.splitlines()[-1].startswith(f"stopped (Ctrl-C); the same command resumes from step {step}: {step} steps")
    assert summary["status"] == "stopped" and summary["stopped_by"] == "SIGINT" and summary["resumes_from"] == step
    assert step >= 10 and step % 5 == 0
    from sdp.dist import World
    from sdp.run.preflight import preflight

    resume = preflight(argv, World(0, 0, 2)).resume  # the same command resumes from there
    assert [c.step for c in resume.candidates] == [step]
