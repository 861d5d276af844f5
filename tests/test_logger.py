"""Run logging: metrics.jsonl always, W&B on rank 0 when asked, never fatal, resumable."""

import json

from sdp.metrics.logger import LoggerConfig, RunLogger


def test_a_resumed_run_continues_its_wandb_run(tmp_path):
    cfg = LoggerConfig(name="wandb", mode="offline", project="sdp-test", group="g", tags=["t"])
    first = RunLogger(cfg, run_dir=tmp_path, run_name="r", config={"a": 1}, active=True)
    first.log({"step": 1, "train_loss": 2.0})
    first.close()
    assert first.wandb_id and len(first.wandb_id) == 8
    again = RunLogger(cfg, run_dir=tmp_path, run_name="r", config={"a": 1}, active=True, resume_id=first.wandb_id)
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
    logger = RunLogger(LoggerConfig(mode="online"), run_dir=tmp_path, run_name="r", config={}, active=True)
    logger.log({"step": 1, "train_loss": 2.0})
    logger.summary({"status": "completed"})
    logger.close()
    assert "W&B start failed" in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


def test_only_rank_0_writes(tmp_path):
    logger = RunLogger(LoggerConfig(), run_dir=tmp_path, run_name="r", config={}, active=False)
    logger.log({"step": 1})
    logger.summary({"status": "completed"})
    logger.close()
    assert list(tmp_path.iterdir()) == []
