"""End to end through torchrun: 2-process gloo DDP for each model family on real data."""

import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from conftest import launch, load_model_pt, read_run

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    """A small corpus of real text: 60 modules of the standard library."""
    src = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]
    dst = tmp_path_factory.mktemp("corpus")
    for path in src:
        shutil.copy(path, dst / path.name)
    return dst


FAMILIES = {
    "resnet": ["model=resnet_tiny", "dataset=fashion_mnist", "logger=wandb"],
    "swin": ["model=swin_tiny", "dataset=fashion_mnist", "logger=none"],
    "llama": ["model=llama_tiny", "dataset=local_text", "dataset.seq_len=64", "logger=none"],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_ddp_run_writes_summary_with_falling_loss(family, tmp_path, text_dir):
    run_dir = tmp_path / "run"
    overrides = FAMILIES[family] + [
        f"run_dir={run_dir}",
        "trainer.max_steps=12",
        "trainer.log_every=3",
        "trainer.eval_every=0",
        "trainer.global_batch_size=32",
        "trainer.progress=false",
        "dataset.eval_batches=2",
        "optim.lr=2e-3",
        "optim.warmup_steps=2",
    ]
    if family == "llama":
        overrides += [f"dataset.path={text_dir}", f"dataset.cache_dir={tmp_path / 'cache'}"]
    proc = launch(overrides, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    summary, records = read_run(run_dir)
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["steps"] == 12
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert summary["eval_loss"] > 0 and (family == "llama" or summary["eval_acc"] > 0.1)
    assert (run_dir / "config.yaml").read_text().count("name: ddp") == 1
    # One evaluation, at the end: the gate cannot say whether the metric still moves.
    assert summary["convergence"] == {
        "metric": "eval_loss" if family == "llama" else "eval_acc",
        "from_step": 9,
        "to_step": 12,
        "threshold": 0.005,
        "change": None,
        "plateaued": None,
        "reason": "no evaluation at or before step 9",
    }
    # trainer.export=hf (the default): the model out of the framework too (tests/test_export.py).
    # local_text: the tokenizer the run trained goes with the model
    llama = ["hf/config.json", "hf/generation_config.json", "hf/model.safetensors"]
    llama += ["hf/tokenizer.json", "hf/tokenizer_config.json"]
    assert summary["export"] == (llama if family == "llama" else ["hf/builder.json", "hf/model.safetensors"])

    # Bytes are what each rank really holds: fp32 params and grads, AdamW's two
    # moments plus one step counter per parameter tensor; DDP all-reduces every gradient once.
    mem, n = summary["memory"], summary["n_params"]
    assert mem["params_bytes"] == mem["grads_bytes"] == 4 * n
    assert mem["optim_bytes"] - 8 * n in range(4, 4 * 1000)
    assert summary["comm_bytes_per_step"] == 4 * n
    assert summary["comm_bytes_per_step_per_rank"] == [4 * n] * summary["world_size"]
    assert summary["tokens_or_samples_per_s"] > 0
    # DDP's own overlap: its wait after the last gradient; its world is its one group.
    assert 0 <= summary["exposed_comm_s"] <= summary["comm_wait_s"] < summary["step_time_s"]
    assert summary["comm_groups_per_rank"] == 1
    if family == "resnet":
        assert list((run_dir / "wandb").glob("offline-run-*")), "W&B offline run missing"
        load_model_pt(run_dir, FAMILIES[family][:2])


@pytest.mark.parametrize(
    "overrides,recalibrates",
    [
        (["masking=none"], True),
        (["masking=backward", "masking.coverage=0.5"], True),
        (["masking=dropout"], True),
        (["masking=none", "masking.bn_recalibration_batches=0"], False),
        (["model=llama_tiny", "dataset=synthetic_text"], False),  # no BatchNorm
    ],
)
def test_every_masking_mode_recalibrates_batchnorm_when_asked(tmp_path, overrides, recalibrates):
    """masking.bn_recalibration_batches gives DDP, backward masking and the baselines their
    calibration batches too (before, forward masking only): the replica tables evaluate all rows alike."""
    from types import SimpleNamespace

    from sdp import dist
    from sdp.models import build_model
    from sdp.run.config import typed_config
    from sdp.run.runner import calibration_stream

    base = ["model=resnet_tiny", "dataset=synthetic_image", "masking.bn_recalibration_batches=2"]
    cfg = typed_config([*base, *overrides, f"output_root={tmp_path}"])
    strategy = SimpleNamespace(model=build_model(cfg.model))
    world = dist.World(rank=0, local_rank=0, world_size=1)
    stream = calibration_stream(cfg, strategy, world=world, batch_size=4)
    assert (stream is not None) == recalibrates
    if recalibrates:
        assert next(stream)["inputs"].shape[0] == 4


def test_bad_override_fails_before_any_process_group(tmp_path):
    run_dir = tmp_path / "never"
    proc = launch(["model=resnet_tiny", "trainer.global_batch_size=33", f"run_dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert ours == [
        "error: trainer.global_batch_size=33: must be divisible by world_size x grad_accum_steps = 2 x 1 = 2"
    ]
    assert not run_dir.exists() and not (tmp_path / "outputs").exists()


def test_failure_after_launch_is_recorded_in_the_summary(tmp_path):
    # A shard too small for one batch is only known once the data is built on each rank.
    run_dir = tmp_path / "run"
    overrides = ["model=resnet_tiny", "dataset=synthetic_image", "dataset.num_samples=16", "logger=none"]
    proc = launch(overrides + ["trainer.global_batch_size=32", f"run_dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode != 0
    summary, _ = read_run(run_dir)
    assert summary["status"] == "failed"
    assert summary["error"].startswith("ConfigError: trainer.global_batch_size='16 per rank': must be <= 8")


@pytest.mark.parametrize("mode", ["forward", "backward"])
def test_sdp_run_through_the_entrypoint(tmp_path, mode):
    """SDP at block level end to end, with the mask resampled after step 2: the summary carries
    the mask and the real (smaller) bytes, and model.pt is the evaluated full model, loadable
    into the plain model."""
    run_dir = tmp_path / "run"
    model = ["model=resnet_tiny", "dataset=synthetic_image"]
    overrides = model + [
        "logger=none",
        f"masking={mode}",
        "masking.granularity=block",
        "masking.coverage=0.5",
        "masking.bn_recalibration_batches=2",
        "masking.resample_every=2",
        "trainer.max_steps=4",
        "trainer.eval_every=2",
        "trainer.global_batch_size=32",
        "trainer.grad_accum_steps=2",
        "dataset.eval_batches=2",
        f"run_dir={run_dir}",
    ]
    proc = launch(overrides, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary, records = read_run(run_dir)
    assert summary["status"] == "completed" and summary["masking"] == mode and summary["granularity"] == "block"
    assert summary["mask"]["holders_per_unit"] == 1 and summary["mask"]["spectral_gap"] == 0.0
    kinds = summary["comm_bytes_per_step_by_kind"]
    assert kinds["grad_sync"] == 0  # r = 1: unit gradients stay on their only holder
    assert kinds["shared_sync"] == 4 * summary["shared_params"]
    assert (kinds["weight_refresh"] > 0) == (mode == "backward")
    assert kinds["resample"] > 0 and summary["resample_every"] == 2
    # 2 workers at r = 1: the world is every rank's only group; waits are measured (the shared sync).
    assert summary["comm_groups_per_rank"] == 1
    assert 0 <= summary["exposed_comm_s"] <= summary["comm_wait_s"] < summary["step_time_s"]
    # Before and after the resample, each rank holds 2 of the 4 blocks and the shared tensors, not everything.
    assert summary["memory"]["grads_bytes"] < 4 * summary["n_params"]
    assert len([r for r in records if "eval_loss" in r]) == 2
    # The convergence gate over steps 3-4 (sdp.metrics.convergence): S(3) is step 2's accuracy
    # (nothing in (2.6, 3]), S(4) step 4's.
    (_, at2), (_, at4) = [(r["step"], r["eval_acc"]) for r in records if "eval_acc" in r]
    gate = summary["convergence"]
    assert gate["metric"] == "eval_acc" and (gate["from_step"], gate["to_step"], gate["threshold"]) == (3, 4, 0.005)
    assert gate["change"] == abs(at4 - at2) / abs(at4) and gate["plateaued"] == (gate["change"] < 0.005)
    plain = load_model_pt(run_dir, model)
    assert torch.isfinite(plain(torch.randn(2, 3, 32, 32))).all()
