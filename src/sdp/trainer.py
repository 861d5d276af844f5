"""The training loop: step, periodic evaluation, metrics."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from sdp import dist
from sdp.data import DataBundle
from sdp.errors import ConfigError
from sdp.metrics.comm import CommCounter
from sdp.metrics.logger import RunLogger
from sdp.metrics.memory import peak_bytes
from sdp.parallel import Strategy


@dataclass
class TrainerConfig:
    max_steps: int = 1000
    global_batch_size: int = 128  # summed over ranks and accumulation steps
    grad_accum_steps: int = 1
    eval_every: int = 200  # 0: evaluate only at the end
    eval_batch_size: int | None = None  # None: the per-rank train micro-batch
    log_every: int = 10
    grad_clip: float = 1.0  # 0: no clipping
    device: str = "auto"  # auto | cpu | cuda
    progress: bool = True
    # Write the final evaluated model (assembled under SDP, with its evaluation
    # scaling and BatchNorm statistics) as model.pt, a state dict of the plain model.
    save_model: bool = True


def validate_trainer(cfg: TrainerConfig, *, world_size: int) -> None:
    """Check the loop's settings, including that the global batch splits evenly."""
    for key in ("max_steps", "global_batch_size", "grad_accum_steps", "log_every"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"trainer.{key}", getattr(cfg, key), "must be >= 1")
    if cfg.eval_every < 0:
        raise ConfigError("trainer.eval_every", cfg.eval_every, "must be >= 0 (0: only at the end)")
    if cfg.eval_batch_size is not None and cfg.eval_batch_size < 1:
        raise ConfigError("trainer.eval_batch_size", cfg.eval_batch_size, "must be >= 1 or null")
    if cfg.grad_clip < 0:
        raise ConfigError("trainer.grad_clip", cfg.grad_clip, "must be >= 0 (0: no clipping)")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ConfigError("trainer.device", cfg.device, "allowed: auto, cpu, cuda")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device", cfg.device, "CUDA is not available here; allowed: auto, cpu")
    per_step = world_size * cfg.grad_accum_steps
    if cfg.global_batch_size % per_step:
        raise ConfigError(
            "trainer.global_batch_size",
            cfg.global_batch_size,
            f"must be divisible by world_size x grad_accum_steps = {world_size} x {cfg.grad_accum_steps} = {per_step}",
        )


def micro_batch_size(cfg: TrainerConfig, *, world_size: int) -> int:
    return cfg.global_batch_size // (world_size * cfg.grad_accum_steps)


def forward_loss(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of a batch, and the logits. One loss serves LMs and classifiers:
    text batches carry next-token targets already shifted by the data pipeline."""
    out = model(batch["inputs"])
    logits = out.logits if hasattr(out, "logits") else out
    loss = F.cross_entropy(logits.flatten(0, -2).float(), batch["targets"].flatten())
    return loss, logits


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.no_grad()
def recalibrate_batchnorm(model: nn.Module, batches: Iterator[dict], *, count: int, device: torch.device) -> None:
    """Recompute BatchNorm running statistics from `count` batches (cumulative average), then
    average them over ranks so that every rank evaluates the same model."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms or count == 0:
        return
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    was_training = model.training
    model.train()
    for _ in range(count):
        model(_to_device(next(batches), device)["inputs"])
    model.train(was_training)
    for m, momentum in zip(norms, momenta, strict=True):
        m.momentum = momentum
        for stat in (m.running_mean, m.running_var):
            dist.all_reduce_(stat).div_(dist.world_size())


@torch.no_grad()
def evaluate(
    strategy: Strategy,
    data: DataBundle,
    *,
    device: torch.device,
    calibration: Iterator[dict] | None = None,
    calibration_batches: int = 0,
    export: Path | None = None,
) -> dict:
    """Loss (and accuracy) over every rank's eval shard, on the full model (assembled under SDP).

    With `export`, that model's plain state dict is also saved there (by the caller's rank 0).
    """
    # [sum of per-target losses, number of targets, correct predictions]
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    with strategy.eval_model() as full:
        if calibration is not None:
            recalibrate_batchnorm(full, calibration, count=calibration_batches, device=device)
        for batch in data.make_eval():
            batch = _to_device(batch, device)
            loss, logits = forward_loss(full, batch)
            n = batch["targets"].numel()
            totals[0] += loss.double() * n
            totals[1] += n
            totals[2] += (logits.argmax(-1) == batch["targets"]).sum()
        if export is not None:
            torch.save(strategy.plain_state_dict(full), export)
    dist.all_reduce_(totals)
    loss_sum, count, correct = totals.tolist()
    if count == 0:
        raise RuntimeError("the eval split is empty on every rank: increase dataset.eval_batches or the eval data")
    result = {"eval_loss": loss_sum / count}
    if data.kind == "image":
        result["eval_acc"] = correct / count
    else:
        result["eval_token_acc"] = correct / count
    return result


def train(
    *,
    strategy: Strategy,
    data: DataBundle,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    cfg: TrainerConfig,
    world: dist.World,
    device: torch.device,
    comm: CommCounter,
    logger: RunLogger,
    units_per_sample: int,
    calibration: Iterator[dict] | None = None,
    calibration_batches: int = 0,
    model_path: Path | None = None,
) -> dict:
    """Run `cfg.max_steps` optimizer steps; returns the loop's part of `summary.json`.

    `units_per_sample` is tokens per sequence for LMs and 1 for images, so the
    throughput reads as tokens/s or samples/s.
    """
    micro = micro_batch_size(cfg, world_size=world.world_size)
    units_per_step = cfg.global_batch_size * units_per_sample
    # Redraw at most every 30 s when stderr is a log file rather than a terminal.
    bar = tqdm(
        total=cfg.max_steps,
        disable=not (cfg.progress and world.is_main),
        desc="train",
        dynamic_ncols=True,
        mininterval=0.1 if sys.stderr.isatty() else 30.0,
    )
    model = strategy.model
    model.train()
    train_time, window_loss, window_steps = 0.0, torch.zeros((), device=device), 0
    memory, measure_memory, last = {}, True, {}
    evals: dict = {}
    for step in range(1, cfg.max_steps + 1):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for i in range(cfg.grad_accum_steps):
            batch = _to_device(next(data.train), device)
            if batch["targets"].shape[0] != micro:
                raise RuntimeError(f"data yielded a batch of {batch['targets'].shape[0]}, expected {micro}")
            last_micro = i == cfg.grad_accum_steps - 1
            with contextlib.nullcontext() if last_micro else strategy.no_sync():
                loss, _ = forward_loss(model, batch)
                (loss / cfg.grad_accum_steps).backward()
            window_loss += loss.detach() / cfg.grad_accum_steps
        strategy.after_backward()
        if cfg.grad_clip > 0:
            strategy.clip_grad_norm_(cfg.grad_clip)
        lr = scheduler.get_last_lr()[0]  # the lr this step used
        optimizer.step()
        strategy.after_step()
        scheduler.step()
        resampled = step < cfg.max_steps and strategy.resample(step, optimizer)
        if resampled:
            model = strategy.model
            model.train()
        comm.end_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_time += time.perf_counter() - t0
        window_steps += 1
        if measure_memory:  # gradients and optimizer state exist from the first step on
            memory = _elementwise_max(memory, strategy.memory(optimizer))
        measure_memory = resampled  # a new subnetwork: measure it after its first step
        bar.update(1)

        if step % cfg.log_every == 0 or step == cfg.max_steps:
            mean_loss = dist.all_reduce_(window_loss.clone()).item() / (window_steps * world.world_size)
            last = {
                "step": step,
                "train_loss": mean_loss,
                "lr": lr,
                "tokens_or_samples_per_s": units_per_step * step / train_time,
                "step_time_s": train_time / step,
            }
            logger.log(last)
            bar.set_postfix(loss=f"{mean_loss:.4f}")
            window_loss.zero_()
            window_steps = 0
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.max_steps:
            final = step == cfg.max_steps and cfg.save_model and world.is_main
            evals = evaluate(
                strategy,
                data,
                device=device,
                calibration=calibration,
                calibration_batches=calibration_batches,
                export=model_path if final else None,
            )
            logger.log({"step": step, **evals})
            if world.is_main:
                bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in evals.items()))
    bar.close()
    peak = peak_bytes(device)
    memory = _max_over_ranks({**memory, "peak_bytes": -1 if peak is None else peak}, device=device)
    memory = {k: None if v < 0 else int(v) for k, v in memory.items()}
    per_step = comm.per_step()
    comm_max = _max_over_ranks({**per_step, "total": sum(per_step.values())}, device=device)
    return {
        "steps": cfg.max_steps,
        "train_loss": last["train_loss"],
        **evals,
        "tokens_or_samples_per_s": last["tokens_or_samples_per_s"],
        "step_time_s": last["step_time_s"],
        "memory": memory,
        # The busiest rank's total, and each kind's busiest rank (not necessarily the same one).
        "comm_bytes_per_step": comm_max.pop("total"),
        "comm_bytes_per_step_by_kind": comm_max,
    }


def _elementwise_max(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: max(a.get(k, v), v) for k, v in b.items()}


def _max_over_ranks(values: dict[str, float], *, device: torch.device) -> dict[str, float]:
    """Each counter's largest value over the ranks: what the busiest device holds or sends.

    Every rank must pass the same keys.
    """
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce_(t, op="max")
    return dict(zip(keys, t.tolist(), strict=True))
