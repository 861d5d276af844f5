"""The model under its strategy: DDP, FSDP or SDP (plain, or x FSDP), with activation
checkpointing, compilation and mixed precision applied from outside it. The entrypoint, the
memory estimator and the GPU checks build through here, so what they measure is what runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sdp import dist
from sdp.metrics.comm import CommCounter
from sdp.models import build_model, computes_loss
from sdp.outer import is_outer
from sdp.outer.view import LocalDDPStrategy
from sdp.parallel import Strategy, move_to
from sdp.parallel.checkpointing import apply_activation_checkpointing
from sdp.parallel.compile import apply_compile, needs_graph_breaks
from sdp.parallel.ddp import DDPStrategy
from sdp.run.config import RunConfig
from sdp.subnet import is_sdp
from sdp.subnet.baselines import BASELINES, apply_unit_noise
from sdp.subnet.plan import SubnetPlan
from sdp.subnet.strategy import SDPStrategy


def build_strategy(
    cfg: RunConfig,
    *,
    world: dist.World,
    device: torch.device,
    comm: CommCounter,
    build: Callable[[Any], torch.nn.Module] = build_model,
    mask_epoch: int = 0,
    ddp: type[DDPStrategy] = DDPStrategy,
    plan: SubnetPlan | None = None,
) -> Strategy:
    """The full model, initialised alike on every rank, under DDP, FSDP or SDP, with activation
    checkpointing and mixed precision applied from outside it.

    `build(model_cfg)` makes a plain model (the estimator passes one that makes fake tensors);
    `mask_epoch` is the SDP mask epoch to start in (a resumed run's); `ddp` is DDP's strategy
    (the estimator passes one with its model of DDP's reducer, which cannot run on fake tensors);
    `plan` is SDP's plan as the preflight built it (None: the strategy builds its own).
    Under an outer loop (outer=diloco) every rank steps alone: DDP without its all-reduce, SDP
    with `local_steps`; the loop's syncs are `sdp.outer.loop.OuterLoop`'s.
    """
    if is_outer(cfg.outer) and ddp is DDPStrategy:
        ddp = LocalDDPStrategy
    made = dict(build=build, mask_epoch=mask_epoch, ddp=ddp, plan=plan)
    strategy = _wrapped(cfg, world=world, device=device, comm=comm, **made)
    strategy.loss_in_model = computes_loss(cfg.model)
    strategy.compiled = compiled_on(cfg.parallelism, device)
    return strategy


def compiled_on(par, device: torch.device) -> bool:
    """parallelism.compile, its default resolved: on CUDA, not on CPU."""
    return par.compile if par.compile is not None else device.type == "cuda"


def _wrapped(
    cfg: RunConfig,
    *,
    world: dist.World,
    device: torch.device,
    comm: CommCounter,
    build: Callable[[Any], torch.nn.Module],
    mask_epoch: int,
    ddp: type[DDPStrategy],
    plan: SubnetPlan | None,
) -> Strategy:
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    par = cfg.parallelism

    compiled = compiled_on(par, device)

    def checkpointing(model: torch.nn.Module) -> None:
        """Activation checkpointing, then compilation, per block (before FSDP wraps them)."""
        apply_activation_checkpointing(model, family=cfg.model.family, mode=par.activation_checkpointing)
        if compiled:
            fullgraph = not needs_graph_breaks(model, family=cfg.model.family)
            apply_compile(model, family=cfg.model.family, fullgraph=fullgraph, backend=str(par.compile_backend))

    if not is_sdp(cfg.masking.name):
        model = move_to(build(cfg.model), device)
        if cfg.masking.name in BASELINES:  # DDP / FSDP with SDP's units dropped at random
            apply_unit_noise(model, family=cfg.model.family, kind=cfg.masking.name, keep=cfg.masking.coverage)
        checkpointing(model)
        if par.name == "fsdp":
            from sdp.parallel.fsdp import FSDPStrategy  # noqa: PLC0415 (FSDP's imports: a third of sdp.train's)

            return FSDPStrategy(model, par, family=cfg.model.family, device=device, comm=comm)
        return ddp(model, par, device=device, comm=comm)

    def make_plain() -> torch.nn.Module:
        with torch.device(device):
            return build(cfg.model)

    common = dict(
        family=cfg.model.family,
        rank=world.rank,
        world_size=world.world_size,
        device=device,
        comm=comm,
        bucket_cap_mb=par.bucket_cap_mb,
        make_plain=make_plain,
        prepare=checkpointing,
        epoch=mask_epoch,
        overlap=par.overlap_comm,
        compiled=compiled,
        plan=plan,
    )
    if par.name == "fsdp":  # SDP x FSDP: FSDP's policy casts, no autocast
        from sdp.subnet.sharded import ShardedSDPStrategy  # noqa: PLC0415 (as FSDPStrategy)

        return ShardedSDPStrategy(build(cfg.model), cfg.masking, parallel=par, **common)
    autocast = torch.bfloat16 if par.mixed_precision == "bf16" else None
    local = is_outer(cfg.outer)
    return SDPStrategy(build(cfg.model), cfg.masking, autocast_dtype=autocast, local_steps=local, **common)
