"""Shared test setup: offline everywhere, a helper to launch torchrun."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from sdp.compare import torchrun_command
from sdp.rundir import read_summary

# The tiny model of each family and a dataset of its kind, shared by the SDP tests.
TINY_MODELS = {
    "llama": ("llama_tiny", "synthetic_text"),
    "resnet": ("resnet_tiny", "synthetic_image"),
    "swin": ("swin_tiny", "synthetic_image"),
}
# One rank of a tiny LLaMA job played in this process (tests/test_mfu.py, test_host_sync.py):
# its overrides, and DDP's and the four SDP variants' at C = 0.5.
ONE_RANK_LLAMA = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=32", "trainer.global_batch_size=8"]
LLAMA_VARIANTS = {
    "DDP": ["masking=none"],
    "N-SDP backward": ["masking=backward", "masking.coverage=0.5"],
    "N-SDP forward": ["masking=forward", "masking.coverage=0.5"],
    "B-SDP backward": ["masking=backward", "masking.granularity=block", "masking.coverage=0.5"],
    "B-SDP forward": ["masking=forward", "masking.granularity=block", "masking.coverage=0.5"],
}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
os.environ.update(OFFLINE_ENV)


@pytest.fixture
def group(tmp_path):
    """A gloo process group of one, in this process (collective code without torchrun)."""
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    tdist.destroy_process_group()


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
    # What the run wrote is exactly the typed record (sdp.rundir.Summary), field for field.
    assert read_summary(run_dir).to_json() == summary
    return summary, records


def tiny_model_cfg(family: str):
    """The typed model config of the family's tiny model."""
    from sdp.config import typed_config

    model, dataset = TINY_MODELS[family]
    return typed_config([f"model={model}", f"dataset={dataset}"])[1].model


def run_harness(scenario: str, nproc: int, out: Path) -> dict:
    """Run one scenario of tests/dist_harness.py under torchrun; returns what rank 0 wrote to `out`."""
    here = Path(__file__).parent
    cmd = torchrun_command(nproc, str(here / "dist_harness.py"), scenario, str(out))
    path = os.pathsep.join(p for p in (str(here), os.environ.get("PYTHONPATH")) if p)  # keep the caller's
    proc = subprocess.run(cmd, env=job_env(PYTHONPATH=path), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def estimator_config(overrides: list[str], world_size: int = 2):
    """A typed, validated run config as the memory estimator loads it (no data checks)."""
    from sdp.config import load_config

    return load_config(overrides, world_size=world_size, offline=True, check_data=False)[1]


def load_model_pt(run_dir: Path, overrides: list[str]):
    """A run's model.pt loaded, strictly, into a freshly built plain model, in eval mode."""
    import torch

    from sdp.config import typed_config
    from sdp.models import build_model

    model = build_model(typed_config(overrides)[1].model)
    model.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True), strict=True)
    return model.eval()
