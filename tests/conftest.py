"""Shared test setup: offline everywhere, a helper to launch torchrun."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from sdp.compare import torchrun_command

# The tiny model of each family and a dataset of its kind, shared by the SDP tests.
TINY_MODELS = {
    "llama": ("llama_tiny", "synthetic_text"),
    "resnet": ("resnet_tiny", "synthetic_image"),
    "swin": ("swin_tiny", "synthetic_image"),
}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
os.environ.update(OFFLINE_ENV)


def launch(overrides: list[str], *, nproc: int = 2, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc_per_node=nproc -m sdp.train overrides` and return the finished process."""
    cmd = torchrun_command(nproc, "-m", "sdp.train", *overrides)
    return subprocess.run(cmd, cwd=cwd, env=job_env(), capture_output=True, text=True, timeout=timeout)


def job_env(**extra: str) -> dict[str, str]:
    """The environment of a launched test job: offline, one thread per process."""
    return {**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}


def read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """summary.json and the records of metrics.jsonl of a finished run."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, records


def tiny_model_cfg(family: str):
    """The typed model config of the family's tiny model."""
    from sdp.config import typed_config

    model, dataset = TINY_MODELS[family]
    return typed_config([f"model={model}", f"dataset={dataset}"])[1].model
