"""Run logging: metrics.jsonl always, W&B on rank 0 when asked, never fatal, resumable."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sdp.errors import ConfigError
from sdp.metrics.logger import LoggerConfig, RunLogger
from sdp.run.config import load_config


def _logger(cfg: LoggerConfig, where: Path, *, active: bool = True, **kwargs) -> RunLogger:
    """A run's logger writing into `where` (its metrics.jsonl and W&B's files)."""
    return RunLogger(cfg, run_dir=where, metrics=where / "metrics.jsonl", run_name="r", active=active, **kwargs)


def test_a_resumed_run_continues_its_wandb_run(tmp_path):
    cfg = LoggerConfig(name="wandb", mode="offline", project="sdp-test", group="g", tags=["t"])
    first = _logger(cfg, tmp_path, config={"a": 1})
    first.log({"step": 1, "train_loss": 2.0})
    first.close()
    assert first.wandb_id and len(first.wandb_id) == 8
    again = _logger(cfg, tmp_path, config={"a": 1}, resume_id=first.wandb_id)
    again.log({"step": 2, "train_loss": 1.0})
    again.close()
    assert again.wandb_id == first.wandb_id
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    # One W&B run id, two segments (W&B adds "-1" when both start within the same second).
    assert len(runs) == 2 and all(f"-{first.wandb_id}" in name for name in runs)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_a_wandb_failure_never_stops_the_run(tmp_path, monkeypatch, capsys):
    import wandb

    def broken(*args, **kwargs):
        raise RuntimeError("no network")

    monkeypatch.setattr(wandb, "init", broken)
    logger = _logger(LoggerConfig(mode="online"), tmp_path, config={})
    logger.log({"step": 1, "train_loss": 2.0})
    logger.summary({"status": "completed"})
    logger.close()
    assert "W&B start failed" in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_only_rank_0_writes(tmp_path):
    logger = _logger(LoggerConfig(), tmp_path, config={}, active=False)
    logger.log({"step": 1})
    logger.summary({"status": "completed"})
    logger.close()
    assert list(tmp_path.iterdir()) == []  # no metrics.jsonl, no wandb/


def test_init_timeout_must_be_positive():
    with pytest.raises(ConfigError, match=r"^logger.init_timeout_s=0.0: must be > 0"):
        load_config(["dataset=synthetic_image", "logger.init_timeout_s=0"], world_size=1, offline=True)


def _short_run(logger: RunLogger) -> None:
    for step in (1, 2):
        logger.log({"step": step, "train_loss": 1.0})
    logger.summary({"status": "completed"})
    logger.close()


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning:")]


def test_every_wandb_call_failing_warns_once_and_redacted(tmp_path, monkeypatch, capsys):
    import wandb

    key = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("WANDB_API_KEY", key)

    class BrokenRun:
        def log(self, *args, **kwargs):
            raise RuntimeError(f"401: bad key {key}")

        @property
        def summary(self):
            raise RuntimeError("down")

        def finish(self, *args, **kwargs):
            raise RuntimeError("down")

    monkeypatch.setattr(wandb, "init", lambda *args, **kwargs: BrokenRun())
    _short_run(_logger(LoggerConfig(), tmp_path, config={}))
    (warning,) = _warnings(capsys.readouterr().err)
    assert warning.startswith("warning: W&B log failed") and key not in warning and "<redacted>" in warning
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2


def test_the_end_of_a_run_waits_for_wandb_at_most_finish_timeout(tmp_path, monkeypatch, capsys):
    # A server gone mid-run: W&B's own finish_timeout ends the wait and raises; we say so once.
    import wandb

    seen = {}

    class StuckRun:
        def log(self, *args, **kwargs):
            pass

        summary = {}

        def finish(self, *args, **kwargs):
            raise TimeoutError("Timed out finishing run.")

    def init(**kwargs):
        seen.update(kwargs)
        return StuckRun()

    monkeypatch.setattr(wandb, "init", init)
    cfg = LoggerConfig(finish_timeout_s=7)
    _short_run(_logger(cfg, tmp_path, config={}))
    assert seen["settings"].finish_timeout == 7 and seen["settings"].finish_timeout_raises
    (warning,) = _warnings(capsys.readouterr().err)
    assert warning.startswith("warning: W&B finish failed, what was not uploaded stays in") and "wandb sync" in warning


@pytest.fixture
def wandb_online(tmp_path, monkeypatch):
    """W&B in online mode against a local port nothing listens on, with no credentials but
    the ones a test sets (HOME is the test's: no ~/.netrc, no W&B settings file)."""
    import wandb

    with socket.socket() as sock:  # a port that was free a moment ago: connections are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    for name in ("WANDB_MODE", "WANDB_API_KEY", "NETRC", "WANDB_CONFIG_DIR", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    wandb.teardown()  # W&B reads the environment once per process: start from this one
    (tmp_path / "run").mkdir()
    yield tmp_path / "run"
    wandb.teardown()  # and stop its service process


def test_an_unreachable_wandb_server_costs_at_most_the_init_timeout(wandb_online, monkeypatch, capsys):
    key = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("WANDB_API_KEY", key)
    start = time.perf_counter()
    logger = _logger(LoggerConfig(mode="online", init_timeout_s=3), wandb_online, config={})
    assert time.perf_counter() - start < 15
    _short_run(logger)
    err = capsys.readouterr().err
    (warning,) = _warnings(err)
    assert warning.startswith("warning: W&B start failed") and key not in err
    assert (wandb_online / "metrics.jsonl").read_text().count("\n") == 2


def test_online_without_an_api_key_continues_without_wandb(wandb_online, capsys):
    start = time.perf_counter()
    logger = _logger(LoggerConfig(mode="online"), wandb_online, config={})
    assert time.perf_counter() - start < 15
    _short_run(logger)
    (warning,) = _warnings(capsys.readouterr().err)
    assert warning.startswith("warning: W&B start failed") and "API key" in warning


def test_online_without_an_api_key_never_waits_for_a_prompt_on_a_terminal(wandb_online):
    """On a terminal `wandb.init` would ask for an API key and wait: the run must not."""
    script = (
        "from pathlib import Path; from sdp.metrics.logger import LoggerConfig, RunLogger; "
        "RunLogger(LoggerConfig(mode='online'), run_dir=Path('.'), metrics=Path('m.jsonl'), run_name='r', "
        "config={}, active=True).close()"
    )
    controller, terminal = os.openpty()
    os.set_blocking(controller, False)  # a read finds what was written, never waits
    try:
        proc = subprocess.run(
            [sys.executable, "-c", script], cwd=wandb_online, stdin=terminal, stderr=terminal, timeout=30
        )
        output = os.read(controller, 65536).decode(errors="replace")
    finally:
        os.close(controller)
        os.close(terminal)
    assert proc.returncode == 0 and "no API key" in output


def test_a_saved_file_goes_with_the_wandb_run(tmp_path):
    # An SDP run's mask.json is published with its W&B record: the offline run holds a copy and
    # a "files" record naming it, for `wandb sync` to upload.
    from wandb_records import records

    logger = _logger(LoggerConfig(name="wandb", mode="offline", project="sdp-test"), tmp_path, config={})
    (tmp_path / "mask.json").write_text('{"spectral_gap": 0.5}')
    logger.save(tmp_path / "mask.json")
    logger.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    assert json.loads((run / "files" / "mask.json").read_text()) == {"spectral_gap": 0.5}
    (path,) = run.glob("run-*.wandb")
    named = [f.path for r in records(path) if r.WhichOneof("record_type") == "files" for f in r.files.files]
    assert "mask.json" in named
