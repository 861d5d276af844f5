"""Shared test setup: offline everywhere, a helper to launch torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
os.environ.update(OFFLINE_ENV)


def launch(overrides: list[str], *, nproc: int = 2, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc_per_node=nproc -m sdp.train overrides` and return the finished process."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "sdp.train",
        *overrides,
    ]
    env = {**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """summary.json and the records of metrics.jsonl of a finished run."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, records


@pytest.fixture
def torchrun():
    return launch
