"""MFU's FLOPs: torchtitan's formula for what a rank runs equals the FLOPs torch counts in a real
step (full loss, no recomputation), under DDP and every SDP variant; no MFU on CPU."""

import dataclasses
import itertools

import pytest
import torch
from conftest import LLAMA_VARIANTS, ONE_RANK_LLAMA
from torch.utils.flop_counter import FlopCounterMode

from sdp import dist
from sdp.metrics.comm import CommCounter
from sdp.metrics.flops import FlopTally, attention_heads, model_flops_per_token
from sdp.optim import build_optimizer
from sdp.planning.estimator import dummy_batch
from sdp.run.build import build_strategy
from sdp.run.config import load_config
from sdp.run.measure import PhaseTimer, count_flops
from sdp.run.trainer import train_step
from sdp.run.trainer_config import micro_batch_size
from sdp.rundir.figures import mfu_entries

CPU = torch.device("cpu")
BASE, VARIANTS = ONE_RANK_LLAMA, LLAMA_VARIANTS
VISION = ["dataset=synthetic_image", "trainer.global_batch_size=4"]


def _one_rank(overrides: list[str], *, rank: int = 1, world_size: int = 2) -> tuple[int, dict, int]:
    """Rank `rank` of a `world_size`-rank job in this process (collectives move nothing): the
    FLOPs counted in its second step, the trainer's MFU entries for it, and the FLOPs a step
    has that torch's counter leaves out: the norms' (elementwise, but parameters the formula
    counts) and, on CPU, attention's (SDPA's CPU kernel has no FLOP formula)."""
    cfg = load_config([*BASE, *overrides], world_size=world_size, offline=True, check_data=False)
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, on_nonfinite="off"))
    micro = micro_batch_size(cfg.trainer, world_size=world_size)
    world = dist.World(rank=rank, local_rank=0, world_size=world_size)
    with dist.fake_process_group(rank, world_size):
        strategy = build_strategy(cfg, world=world, device=CPU, comm=CommCounter())
        optimizer = build_optimizer(strategy.trainable(), cfg.optim)
        batches = itertools.repeat(dummy_batch(cfg, micro))

        def run_step():
            return train_step(
                strategy, optimizer, batches, cfg=cfg.trainer, micro=micro, device=CPU, timer=PhaseTimer(CPU)
            )

        run_step()
        _, counted = count_flops(run_step)
        tokens = micro * cfg.dataset.seq_len
        entries = mfu_entries(
            strategy, device=CPU, precision="fp32", flops=counted, step_time=1.0, tokens_per_rank=tokens, seq_len=32
        )
        heads, head_dim = attention_heads(strategy.model)
        norms_run = sum(p.numel() for p in strategy.model.parameters() if p.dim() == 1)
        norms_trained = sum(p.numel() for p in strategy.trainable() if p.dim() == 1)
    uncounted = (4 * norms_run + 2 * norms_trained + 12 * heads * head_dim * cfg.dataset.seq_len) * tokens
    return counted, entries, uncounted


@pytest.mark.parametrize("variant", VARIANTS)
def test_model_flops_are_the_flops_the_step_runs(variant):
    counted, entries, uncounted = _one_rank([*VARIANTS[variant], "model.loss=full"])
    assert entries["mfu_flops"] == "model (torchtitan)"
    assert entries["mfu_flops_per_step"] == counted + uncounted
    assert entries["mfu"] is None and entries["mfu_peak"] is None  # CPU: no peak to divide by


def test_ddp_model_flops_are_torchtitans_formula():
    # llama_tiny: 4 layers, 4 heads of 32, vocabulary 4096, hidden 128; 4 x 32 tokens a rank.
    _, entries, _ = _one_rank(["masking=none"])
    torch.manual_seed(0)
    from sdp.models import build_model
    from sdp.run.config import typed_config

    model = build_model(typed_config([*BASE]).model)
    non_embedding = sum(p.numel() for p in model.parameters()) - 4096 * 128
    assert entries["mfu_flops_per_step"] == (6 * non_embedding + 12 * 4 * 4 * 32 * 32) * 4 * 32


def test_recomputation_is_not_model_flops():
    # Activation checkpointing and the chunked loss run more FLOPs than the model's.
    counted, entries, uncounted = _one_rank(["masking=none", "parallelism.activation_checkpointing=full"])
    assert counted + uncounted > entries["mfu_flops_per_step"]
    assert entries["mfu_flops_per_step"] == _one_rank(["masking=none", "model.loss=full"])[1]["mfu_flops_per_step"]


def test_the_formula_credits_backward_masking_only_its_held_weight_gradients():
    full = model_flops_per_token(forward_params=100, trained_params=100, heads=2, head_dim=4, seq_len=8)
    held = model_flops_per_token(forward_params=100, trained_params=50, heads=2, head_dim=4, seq_len=8)
    assert full == 6 * 100 + 12 * 2 * 4 * 8 and full - held == 2 * 50


@pytest.mark.parametrize(
    "overrides",
    [
        [*BASE, "masking=backward", "masking.coverage=0.5", "parallelism.activation_checkpointing=full"],
        [*BASE, "masking=forward", "masking.coverage=0.5", "parallelism.activation_checkpointing=selective"],
        [*VISION, "model=resnet_tiny", "masking=forward", "masking.coverage=0.5"],
        [*VISION, "model=swin_tiny", "masking=none"],
    ],
)
def test_the_tally_counts_what_torchs_flop_counter_counts(overrides):
    # FlopTally drops FlopCounterMode's module tracking and decompositions (which change what a
    # step keeps alive), not a FLOP: the same total over the same step, checkpointing included.
    cfg = load_config(overrides, world_size=2, offline=True, check_data=False)
    # Rank 1 receives nothing under the fake group: what a broadcast would fill (the held units'
    # initial values) stays as torch.empty left it, so its values may be non-finite; FLOPs are not.
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, on_nonfinite="off"))
    micro = micro_batch_size(cfg.trainer, world_size=2)
    with dist.fake_process_group(1, 2):
        world = dist.World(rank=1, local_rank=0, world_size=2)
        strategy = build_strategy(cfg, world=world, device=CPU, comm=CommCounter())
        optimizer = build_optimizer(strategy.trainable(), cfg.optim)
        batches = itertools.repeat(dummy_batch(cfg, micro))
        timer, counts = PhaseTimer(CPU), []
        for counter in (FlopCounterMode(display=False), FlopTally()):
            with counter:
                train_step(strategy, optimizer, batches, cfg=cfg.trainer, micro=micro, device=CPU, timer=timer)
            counts.append(counter.get_total_flops())
    assert counts[1] == counts[0] > 0
