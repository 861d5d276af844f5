"""The single entrypoint: `torchrun --nproc_per_node=N -m sdp.train [group=option ...] [key=value ...]`.

compose config -> validate (before any process group) -> build -> train -> close.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from sdp import dist
from sdp.config import RunConfig, load_config
from sdp.data import build_data, prepare_data
from sdp.errors import ConfigError
from sdp.metrics.comm import CommCounter
from sdp.metrics.logger import RunLogger
from sdp.models import build_model
from sdp.optim import build_optimizer, build_scheduler
from sdp.parallel import DDPStrategy, Strategy, move_to
from sdp.parallel.checkpointing import apply_activation_checkpointing
from sdp.parallel.fsdp import FSDPStrategy
from sdp.parallel.sharded import ShardedSDPStrategy
from sdp.subnet.strategy import SDPStrategy
from sdp.trainer import micro_batch_size, train


def run_name(cfg: RunConfig) -> str:
    return cfg.name or f"{cfg.model.name}-{cfg.dataset.name}-{cfg.masking.name}"


def choose_run_dir(cfg: RunConfig) -> Path:
    """The run dir, decided by rank 0 only (a timestamp differs between processes)."""
    if cfg.run_dir:
        return Path(cfg.run_dir)
    base = Path(cfg.output_root) / f"{time.strftime('%Y%m%d-%H%M%S')}-{run_name(cfg)}"
    candidate, n = base, 0
    while candidate.exists():  # two runs started in the same second
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def check_run_dir(cfg: RunConfig) -> None:
    """Refuse to write into a finished or running run: nothing written so far is lost."""
    if cfg.run_dir and (Path(cfg.run_dir) / "metrics.jsonl").exists():
        raise ConfigError("run_dir", cfg.run_dir, "already holds a run (metrics.jsonl); choose a new run_dir")


def build_strategy(
    cfg: RunConfig,
    *,
    world: dist.World,
    device: torch.device,
    comm: CommCounter,
    build: Callable[[Any], torch.nn.Module] = build_model,
) -> Strategy:
    """The full model, initialised alike on every rank, under DDP, FSDP or SDP, with activation
    checkpointing and mixed precision applied from outside it.

    `build(model_cfg)` makes a plain model (the estimator passes one that makes fake tensors).
    """
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    par = cfg.parallelism

    def checkpointing(model: torch.nn.Module) -> None:
        apply_activation_checkpointing(model, family=cfg.model.family, mode=par.activation_checkpointing)

    if cfg.masking.name == "none":
        model = move_to(build(cfg.model), device)
        checkpointing(model)
        if par.name == "fsdp":
            return FSDPStrategy(model, par, family=cfg.model.family, device=device, comm=comm)
        return DDPStrategy(model, par, device=device, comm=comm)

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
    )
    if par.name == "fsdp":  # SDP x FSDP: FSDP's policy casts, no autocast
        return ShardedSDPStrategy(build(cfg.model), cfg.masking, parallel=par, **common)
    autocast = torch.bfloat16 if par.mixed_precision == "bf16" else None
    return SDPStrategy(build(cfg.model), cfg.masking, autocast_dtype=autocast, **common)


def calibration_stream(cfg: RunConfig, strategy: Strategy, *, world: dist.World, batch_size: int):
    """Training batches for BatchNorm recalibration of an assembled model, from a stream of
    their own (another seed), so the training data order is not disturbed; None when unused."""
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in strategy.model.modules())
    if cfg.masking.name != "forward" or cfg.masking.bn_recalibration_batches == 0 or not has_bn:
        return None
    data = build_data(
        cfg.dataset,
        rank=world.rank,
        world_size=world.world_size,
        batch_size=batch_size,
        eval_batch_size=batch_size,
        seed=cfg.seed + 1,
    )
    return data.train


def run(raw: DictConfig, cfg: RunConfig, world: dist.World) -> dict:
    """Train one configured run on this rank; rank 0 writes the run dir."""
    device = dist.select_device(cfg.trainer.device, world)
    backend = dist.default_backend(device) if cfg.parallelism.backend == "auto" else cfg.parallelism.backend
    dist.init_process_group(world, backend=backend)
    logger = None
    summary = {
        "status": "running",
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "world_size": world.world_size,
        "coverage": cfg.masking.coverage,
        "masking": cfg.masking.name,
        "parallelism": cfg.parallelism.name,
        "activation_checkpointing": cfg.parallelism.activation_checkpointing,
        "mixed_precision": cfg.parallelism.mixed_precision,
        "device": device.type,
        "seed": cfg.seed,
    }
    try:
        run_dir = Path(dist.broadcast_object(str(choose_run_dir(cfg)) if world.is_main else None))
        summary["run_dir"] = str(run_dir)
        if world.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(raw))
        logger = RunLogger(
            cfg.logger,
            run_dir=run_dir,
            run_name=run_name(cfg),
            active=world.is_main,
            config=OmegaConf.to_container(raw, resolve=True),
        )
        if world.is_main:
            prepare_data(cfg.dataset)
        dist.barrier()

        micro = micro_batch_size(cfg.trainer, world_size=world.world_size)
        data = build_data(
            cfg.dataset,
            rank=world.rank,
            world_size=world.world_size,
            batch_size=micro,
            eval_batch_size=cfg.trainer.eval_batch_size or micro,
            seed=cfg.seed,
        )
        comm = CommCounter()
        strategy = build_strategy(cfg, world=world, device=device, comm=comm)
        summary["n_params"] = strategy.full_params
        summary.update(strategy.describe())
        optimizer = build_optimizer(strategy.trainable(), cfg.optim)
        scheduler = build_scheduler(optimizer, cfg.optim, max_steps=cfg.trainer.max_steps)
        summary["throughput_unit"] = "tokens/s" if data.kind == "text" else "samples/s"
        calibration = calibration_stream(cfg, strategy, world=world, batch_size=micro)
        dist.print0(
            world,
            f"run dir: {run_dir}  ({cfg.model.name}: {summary['n_params'] / 1e6:.2f}M params, "
            f"{world.world_size} x {micro} per step, {cfg.trainer.max_steps} steps, {device.type}/{backend})",
        )
        summary.update(
            train(
                strategy=strategy,
                data=data,
                optimizer=optimizer,
                scheduler=scheduler,
                cfg=cfg.trainer,
                world=world,
                device=device,
                comm=comm,
                logger=logger,
                units_per_sample=cfg.dataset.seq_len if data.kind == "text" else 1,
                calibration=calibration,
                calibration_batches=cfg.masking.bn_recalibration_batches,
                model_path=run_dir / "model.pt",
                precision=cfg.parallelism.mixed_precision,
            )
        )
        summary["status"] = "completed"
        return summary
    except KeyboardInterrupt:
        summary["status"] = "interrupted"
        raise
    except Exception as err:
        summary.update(status="failed", error=f"{type(err).__name__}: {err}")
        raise
    finally:
        if logger is not None:
            logger.summary(summary)
            logger.close(exit_code=0 if summary["status"] == "completed" else 1)
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    overrides = sys.argv[1:] if argv is None else argv
    world = dist.world_from_env()
    try:
        raw, cfg = load_config(overrides, world_size=world.world_size, offline=dist.hub_offline())
        check_run_dir(cfg)
    except ConfigError as err:
        dist.print0(world, f"error: {err}", file=sys.stderr)
        return 2
    summary = run(raw, cfg, world)
    if world.is_main:
        print_result(summary)
    return 0


def print_result(summary: dict) -> None:
    """A short human-readable result line block for the terminal."""
    mem = summary["memory"]
    static_mib = sum(mem[k] for k in ("params_bytes", "grads_bytes", "optim_bytes")) / 2**20
    quality = " ".join(f"{k}={summary[k]:.4f}" for k in ("train_loss", "eval_loss", "eval_acc") if k in summary)
    speed = summary["tokens_or_samples_per_s"]
    speed = "" if speed is None else f"{speed:.1f} {summary['throughput_unit']}, "
    peak = "" if mem["peak_bytes"] is None else f", live peak {mem['peak_bytes'] / 2**20:.1f} MiB/rank"
    print(
        f"done: {summary['steps']} steps, {quality}, {speed}"
        f"params+grads+optim {static_mib:.1f} MiB/rank{peak}, "
        f"comm {summary['comm_bytes_per_step'] / 2**20:.2f} MiB/step -> {summary['run_dir']}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
