"""The paper's experiment configs: every one composes with every variant, and runs."""

import pytest
from conftest import launch, read_run

from sdp.errors import ConfigError
from sdp.run.config import group_options, load_config

# The CPU stand-ins: demo_* (make run) and replica_* (make tables' sizes of demo_fmnist's model
# and data, composed by test_cpu_replica).
PAPER = [e for e in group_options("experiment") if not e.startswith(("demo_", "replica_"))]
LAUNCHED = [e for e in group_options("experiment") if not e.startswith("replica_")]
SDP_VARIANTS = [v for v in group_options("variant") if "_sdp_" in v]
BASELINES = ["dropout", "stochastic_depth"]
# The tiny stand-in of each family, on synthetic data of its kind, for the launch test.
TINY = {
    "llama": ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=32"],
    "resnet": ["model=resnet_tiny", "dataset=synthetic_image"],
    "swin": ["model=swin_tiny", "dataset=synthetic_image"],
}


def test_the_paper_tables_have_their_experiments():
    assert sorted(PAPER) == sorted(
        [f"llama_{m}_fineweb" for m in ("134m", "500m", "1b")]
        + [f"{m}_{d}" for m in ("resnet18", "swin_t") for d in ("cifar10", "cifar100")]
        + ["resnet18_imagenet"]
    )
    assert sorted(group_options("variant")) == sorted(
        ["ddp", "n_sdp_backward", "n_sdp_forward", "b_sdp_backward", "b_sdp_forward", *BASELINES]
    )


@pytest.mark.parametrize("experiment", PAPER)
def test_every_experiment_composes_with_every_variant_on_8_workers(experiment):
    ddp = load_config([f"experiment={experiment}", "variant=ddp"], world_size=8, offline=True, check_data=False)
    assert ddp.masking.name == "none" and ddp.trainer.global_batch_size % 8 == 0
    for variant in SDP_VARIANTS:
        overrides = [f"experiment={experiment}", f"variant={variant}", "masking.coverage=0.5"]
        cfg = load_config(overrides, world_size=8, offline=True, check_data=False)
        mode, gran = variant.split("_sdp_")[1], "neuron" if variant.startswith("n_") else "block"
        assert (cfg.masking.name, cfg.masking.granularity, cfg.masking.coverage) == (mode, gran, 0.5)
        assert cfg.model == ddp.model and cfg.optim == ddp.optim and cfg.trainer == ddp.trainer
        # The paper's protocol: SDP at coverage C takes 1/C as many steps (and warmup) as DDP.
        matched = load_config(
            [*overrides, "trainer.protocol=flop_matched"], world_size=8, offline=True, check_data=False
        )
        assert matched.trainer.max_steps == 2 * ddp.trainer.max_steps
        assert matched.optim.warmup_steps == 2 * ddp.optim.warmup_steps
    for baseline in BASELINES:  # DDP with SDP's units dropped at keep rate C: DDP's steps
        overrides = [f"experiment={experiment}", f"variant={baseline}", "masking.coverage=0.5"]
        cfg = load_config([*overrides, "trainer.protocol=flop_matched"], world_size=8, offline=True, check_data=False)
        assert cfg.masking.name == baseline and cfg.trainer.max_steps == ddp.trainer.max_steps
        assert cfg.optim == ddp.optim


def test_flop_matching_leaves_ddp_alone_and_bad_protocols_are_named():
    base = ["experiment=llama_134m_fineweb", "trainer.protocol=flop_matched"]
    ddp = load_config([*base, "variant=ddp"], world_size=8, offline=True, check_data=False)
    assert ddp.trainer.max_steps == 20000
    with pytest.raises(ConfigError) as info:
        load_config([*base, "trainer.protocol=flops"], world_size=8, offline=True, check_data=False)
    assert str(info.value).startswith("trainer.protocol") and "same_iteration, flop_matched" in str(info.value)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("experiment", LAUNCHED)
def test_every_experiment_runs_two_steps_on_tiny_overrides(tmp_path, experiment):
    cfg = load_config([f"experiment={experiment}"], world_size=2, offline=True, check_data=False)
    family = cfg.model.family
    variant = "variant=b_sdp_forward" if family == "swin" else "variant=n_sdp_forward"  # Swin-tiny: 2 heads
    overrides = [f"experiment={experiment}", *TINY[family], variant, "masking.coverage=0.5"]
    overrides += ["trainer.max_steps=2", "trainer.global_batch_size=8", "trainer.eval_every=0", "logger=none"]
    overrides += ["dataset.eval_batches=1", "optim.warmup_steps=1", f"run_dir={tmp_path / 'run'}"]
    proc = launch(overrides, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary, _ = read_run(tmp_path / "run")
    assert summary["status"] == "completed" and summary["steps"] == 2 and summary["masking"] == "forward"
