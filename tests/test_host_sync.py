"""A steady-state training step reads nothing back to the host: with a fused optimizer the
NaN/Inf guard decides on the device, so no step of DDP or any SDP variant calls
`aten._local_scalar_dense` (what `.item()`, `.tolist()`, `float(t)` and `if t:` dispatch to: on
CUDA, each one is a host-device synchronisation)."""

import dataclasses
import itertools

import pytest
import torch
from conftest import LLAMA_VARIANTS, ONE_RANK_LLAMA
from torch.utils._python_dispatch import TorchDispatchMode

from sdp import dist
from sdp.metrics.comm import CommCounter
from sdp.optim import build_optimizer
from sdp.planning.estimator import dummy_batch
from sdp.run.build import build_strategy
from sdp.run.config import load_config
from sdp.run.measure import PhaseTimer
from sdp.run.nonfinite import NonFiniteGuard
from sdp.run.trainer import train_step
from sdp.run.trainer_config import micro_batch_size

CPU = torch.device("cpu")
BASE, VARIANTS = ONE_RANK_LLAMA, LLAMA_VARIANTS


class _HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _host_reads(overrides: list[str], *, on_device: bool = True) -> int:
    """Host reads in steps 2-3 of rank 1 of 2 (played in this process), fused AdamW, clipping and
    the NaN/Inf guard on: on the device, or (`on_device=False`) the host's check."""
    cfg = load_config([*BASE, *overrides, "optim.implementation=fused"], world_size=2, offline=True, check_data=False)
    micro = micro_batch_size(cfg.trainer, world_size=2)
    with dist.fake_process_group(1, 2):
        strategy = build_strategy(
            cfg, world=dist.World(rank=1, local_rank=0, world_size=2), device=CPU, comm=CommCounter()
        )
        optimizer = build_optimizer(strategy.trainable(), cfg.optim, device=CPU)
        guard = NonFiniteGuard("stop", max_skips=0, device=CPU) if on_device else None
        batches = itertools.repeat(dummy_batch(cfg, micro))
        trainer = dataclasses.replace(cfg.trainer, on_nonfinite="stop")

        def step():
            train_step(
                strategy, optimizer, batches, cfg=trainer, micro=micro, device=CPU, timer=PhaseTimer(CPU), guard=guard
            )

        step()  # the first step makes the optimizer state
        with _HostReads() as reads:
            step()
            step()
    return reads.count


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_step_with_a_fused_optimizer_reads_nothing_back(variant):
    assert _host_reads(VARIANTS[variant]) == 0


def test_the_host_check_reads_once_a_step():
    assert _host_reads(VARIANTS["DDP"], on_device=False) == 2  # the count sees reads where they are


def test_causal_attention_without_a_mask_is_transformers_sdpa_bit_for_bit():
    from conftest import tiny_model_cfg

    from sdp.models import build_model

    torch.manual_seed(0)
    model = build_model(tiny_model_cfg("llama"))
    tokens = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(1))
    ours = model(tokens).logits
    model.config._attn_implementation = "sdpa"  # transformers' own, which builds its mask first
    assert torch.equal(ours, model(tokens).logits)
