"""The training loop: step, periodic evaluation, metrics."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from sdp import dist
from sdp.data import DataBundle
from sdp.data.prefetch import to_device
from sdp.errors import ConfigError, Interrupted, WriteFailed
from sdp.metrics.logger import RunLogger
from sdp.parallel import Strategy
from sdp.run.checkpoint import Checkpointer
from sdp.run.measure import Meter, PhaseTimer
from sdp.run.nonfinite import NonFiniteGuard, NonFinitePolicy, NonFiniteStep, OnNonFinite, check_finite
from sdp.rundir import write_error


class Protocol(StrEnum):
    """trainer.protocol: same_iteration, every variant takes max_steps steps; flop_matched (the
    paper's), an SDP run takes max_steps / coverage steps (and warmup)."""

    same_iteration = "same_iteration"
    flop_matched = "flop_matched"


class Device(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Export(StrEnum):
    """trainer.export: hf, RUN_DIR/hf/ from model.pt in the family's standard format (a
    transformers LlamaForCausalLM; safetensors and builder.json for vision); none."""

    hf = "hf"
    none = "none"


@dataclass
class TrainerConfig:
    max_steps: int = 1000
    global_batch_size: int = 128  # summed over ranks and accumulation steps
    grad_accum_steps: int = 1
    eval_every: int = 200  # 0: evaluate only at the end
    eval_batch_size: int | None = None  # None: the per-rank train micro-batch
    log_every: int = 10
    grad_clip: float = 1.0  # 0: no clipping
    device: Device = Device.auto
    progress: bool = True
    # Write the final evaluated model (assembled under SDP, with its evaluation
    # scaling and BatchNorm statistics) as model.pt, a state dict of the plain model.
    save_model: bool = True
    # hf: with save_model, also RUN_DIR/hf/ (sdp.rundir.hf): from_pretrained-loadable for
    # LLaMA, safetensors and builder.json for vision; none: model.pt only.
    export: Export = Export.hf
    # The step run under the live-tensor memory tracker (FLOPs are counted on the
    # step before it); both are left out of the timings; 0: none. Step 3 is steady
    # state: the optimizer state exists (step 1) and DDP has re-bucketed (step 2).
    profile_step: int = 3
    # Resumable runs: a checkpoint every N steps in RUN_DIR/checkpoints (0: none), keeping
    # the newest `keep_checkpoints`; the same command with the same run_dir resumes.
    checkpoint_every: int = 500
    keep_checkpoints: int = 2  # >= 2: a damaged newest checkpoint falls back to the one before
    # End this launch after this step, with a checkpoint, as a preemption would (0: never).
    stop_at_step: int = 0
    # same_iteration: every variant takes max_steps steps. flop_matched (the paper's): an SDP
    # run takes max_steps / coverage steps (and warmup), max_steps being the DDP budget.
    protocol: Protocol = Protocol.same_iteration
    # A step whose loss or gradient is NaN/Inf on any rank (checked after the gradient sync,
    # before the update; see sdp.run.nonfinite): stop (write nonfinite_step_N.json and fail,
    # keeping the last good checkpoint), skip (drop the update; stop after max_nonfinite_skips
    # such steps) or off (no check: saves a 2-element all-reduce per step).
    on_nonfinite: OnNonFinite = OnNonFinite.stop
    max_nonfinite_skips: int = 10


def validate_trainer(cfg: TrainerConfig, *, world_size: int) -> None:
    """Check the loop's settings, including that the global batch splits evenly."""
    for key in ("max_steps", "global_batch_size", "grad_accum_steps", "log_every"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"trainer.{key}", getattr(cfg, key), "must be >= 1")
    for key in ("checkpoint_every", "stop_at_step"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"trainer.{key}", getattr(cfg, key), "must be >= 0 (0: off)")
    if cfg.max_nonfinite_skips < 0:
        raise ConfigError("trainer.max_nonfinite_skips", cfg.max_nonfinite_skips, "must be >= 0")
    if cfg.keep_checkpoints < 1:
        raise ConfigError("trainer.keep_checkpoints", cfg.keep_checkpoints, "must be >= 1")
    if cfg.profile_step < 0:
        raise ConfigError("trainer.profile_step", cfg.profile_step, "must be >= 0 (0: no memory/FLOP probe)")
    if cfg.eval_every < 0:
        raise ConfigError("trainer.eval_every", cfg.eval_every, "must be >= 0 (0: only at the end)")
    if cfg.eval_batch_size is not None and cfg.eval_batch_size < 1:
        raise ConfigError("trainer.eval_batch_size", cfg.eval_batch_size, "must be >= 1 or null")
    if cfg.grad_clip < 0:
        raise ConfigError("trainer.grad_clip", cfg.grad_clip, "must be >= 0 (0: no clipping)")
    if cfg.export == "hf" and not cfg.save_model:
        raise ConfigError(
            "trainer.export",
            cfg.export,
            "is made from model.pt: needs trainer.save_model=true (or trainer.export=none)",
        )
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


def forward_loss(model: nn.Module, batch: dict, *, in_model: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean cross-entropy of a batch and, with gradients off (evaluation), the number of correct
    predictions (None otherwise). One loss serves LMs and classifiers: text batches carry
    next-token targets already shifted by the data pipeline. `in_model`: the model computes
    it itself from `targets` (the LLaMA's, chunked or full; `Strategy.loss_in_model`)."""
    if in_model:
        return model(batch["inputs"], targets=batch["targets"])
    out = model(batch["inputs"])
    logits = out.logits if hasattr(out, "logits") else out
    targets = batch["targets"].flatten()
    loss = F.cross_entropy(logits.flatten(0, -2).float(), targets)
    correct = None if torch.is_grad_enabled() else (logits.flatten(0, -2).argmax(-1) == targets).sum()
    return loss, correct


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
    write_export: bool = True,
) -> dict:
    """Loss (and accuracy) over every rank's eval shard, on the full model (assembled under SDP).

    With `export` (given on every rank: gathering a sharded state dict is collective), that
    model's plain state dict is also saved there by the rank with `write_export`.
    """
    # [sum of per-target losses, number of targets, correct predictions]
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    with strategy.eval_model() as full:
        if calibration is not None:
            recalibrate_batchnorm(full, calibration, count=calibration_batches, device=device)
        for batch in data.make_eval():
            batch = _to_device(batch, device)
            with strategy.autocast():
                loss, correct = forward_loss(full, batch, in_model=strategy.loss_in_model)
            n = batch["targets"].numel()
            totals[0] += loss.double() * n
            totals[1] += n
            totals[2] += correct
        failed = None
        if export is not None:
            state = strategy.plain_state_dict(full)
            if write_export:
                failed = save_model(state, export)
    dist.all_reduce_(totals)
    failed = dist.broadcast_object(failed) if export is not None else None  # every rank stops alike
    if failed:
        raise WriteFailed(f"the final model was not written: {failed}")
    loss_sum, count, correct = totals.tolist()
    if count == 0:
        raise RuntimeError("the eval split is empty on every rank: increase dataset.eval_batches or the eval data")
    result = {"eval_loss": loss_sum / count}
    if data.kind == "image":
        result["eval_acc"] = correct / count
    else:
        result["eval_token_acc"] = correct / count
    return result


def train_step(
    strategy: Strategy,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[dict],
    *,
    cfg: TrainerConfig,
    micro: int,
    device: torch.device,
    timer: PhaseTimer,
    guard: NonFiniteGuard | None = None,
) -> torch.Tensor:
    """One optimizer step over cfg.grad_accum_steps micro-batches; returns the mean loss (detached).

    The NaN/Inf check (cfg.on_nonfinite) runs on the device through `guard` when one is given
    (a fused optimizer, see sdp.run.nonfinite), else on the host, raising NonFiniteStep. The
    estimator runs this same function under FakeTensorMode, so what it measures is what runs.
    """
    model = strategy.model
    optimizer.zero_grad(set_to_none=True)
    step_loss = torch.zeros((), device=device)
    for i in range(cfg.grad_accum_steps):
        with timer("data"):
            batch = _to_device(next(batches), device)
        if batch["targets"].shape[0] != micro:
            raise RuntimeError(f"data yielded a batch of {batch['targets'].shape[0]}, expected {micro}")
        last_micro = i == cfg.grad_accum_steps - 1
        with contextlib.nullcontext() if last_micro else strategy.no_sync():
            with timer("forward"), strategy.autocast():
                loss, _ = forward_loss(model, batch, in_model=strategy.loss_in_model)
            with timer("backward"):
                (loss / cfg.grad_accum_steps).backward()
        step_loss += loss.detach() / cfg.grad_accum_steps
    with timer("sync"):
        strategy.after_backward()
        norm = strategy.clip_grad_norm_(cfg.grad_clip) if cfg.grad_clip > 0 else None
        if guard is not None:
            guard.check(strategy, optimizer, step_loss, norm)
        elif cfg.on_nonfinite != "off":
            check_finite(strategy, step_loss, norm)
    with timer("optimizer"):
        optimizer.step()
    with timer("sync"):
        strategy.after_step()
    return step_loss


def save_model(state: dict, path: Path) -> str | None:
    """torch.save through a temporary file, removed when the write fails (a full disk), so
    `path` is the whole new model or not there; None, or the failure in one line."""
    tmp = path.with_name(path.name + ".partial")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:
        return write_error(err, path)
    finally:
        tmp.unlink(missing_ok=True)
    return None


@dataclass
class Evaluation:
    """The loop's evaluations: loss (and accuracy) on the full model over every rank's eval
    shard, after BatchNorm recalibration from `calibration` under forward masking; the final one
    also writes that model to `model_path` (None: not saved)."""

    data: DataBundle
    device: torch.device
    world: dist.World
    calibration: Iterator[dict] | None = None
    calibration_batches: int = 0
    model_path: Path | None = None

    def __call__(self, strategy: Strategy, *, final: bool) -> dict:
        return evaluate(
            strategy,
            self.data,
            device=self.device,
            calibration=self.calibration,
            calibration_batches=self.calibration_batches,
            export=self.model_path if final else None,
            write_export=self.world.is_main,
        )


def train(
    *,
    strategy: Strategy,
    data: DataBundle,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    cfg: TrainerConfig,
    world: dist.World,
    logger: RunLogger,
    meter: Meter,
    nonfinite: NonFinitePolicy,
    checkpointer: Checkpointer,
    evaluation: Evaluation,
    start_step: int = 0,
    stop_requested: Callable[[], bool] | None = None,
) -> dict:
    """Run optimizer steps start_step + 1 ... cfg.max_steps; returns the loop's entries of
    summary.json. Each component keeps its own timing: the meter what it measures, the NaN/Inf
    policy its checks, the checkpointer its interval. A run stops early, with a checkpoint, at
    cfg.stop_at_step or when `stop_requested()` (collective, read at log steps) says so."""
    micro, device = micro_batch_size(cfg, world_size=world.world_size), meter.device
    bar = progress_bar(cfg, world)
    strategy.model.train()
    batches = to_device(data.train, device)

    def run_step() -> torch.Tensor:
        return train_step(
            strategy, optimizer, batches, cfg=cfg, micro=micro, device=device, timer=meter.timer, guard=nonfinite.guard
        )

    stopped_at, evals, done = None, {}, start_step
    try:
        bar.update(start_step)
        for step in range(start_step + 1, cfg.max_steps + 1):
            done = step - 1
            try:
                meter.add_loss(meter.run(step, run_step), nonfinite.applied())
            except NonFiniteStep as bad:  # raised on every rank before the update: the model is the last good one
                nonfinite.raised(bad, step=step, last_checkpoint=checkpointer.last)
                optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]  # the lr this step used
            scheduler.step()
            resampled = step < cfg.max_steps and strategy.resample(step, optimizer)
            if resampled:
                strategy.model.train()
            meter.end(step, resampled=resampled)
            bar.update(1)
            log_step = step % cfg.log_every == 0 or step == cfg.max_steps
            eval_step = (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.max_steps
            stopping = step < cfg.max_steps and (
                step == cfg.stop_at_step or (log_step and stop_requested is not None and stop_requested())
            )
            if not (log_step or eval_step or checkpointer.due(step) or stopping):
                continue  # no host sync in this step
            meter.sync()  # the host waits for the device here
            nonfinite.report(found_at=step, last_checkpoint=checkpointer.last)
            if log_step or stopping:
                _log_train(meter.window(step, lr), logger=logger, bar=bar)
            if eval_step:
                evals = evaluation(strategy, final=step == cfg.max_steps)
                _log_eval(step, evals, logger=logger, bar=bar, world=world)
            if checkpointer.due(step) or stopping:
                checkpointer.save(step, meter.measured())
            if stopping:
                stopped_at = step
                break
    except KeyboardInterrupt:  # a second Ctrl-C: the steps done so far, and where a resume starts
        raise Interrupted(done, checkpointer.last) from None
    finally:  # the bar ends its line before anything else is printed
        bar.close()
    return {
        "steps": stopped_at or cfg.max_steps,
        "stopped_at": stopped_at,
        "resumes_from": checkpointer.last if stopped_at else None,
        "resumed_from": start_step or None,
        "train_loss": meter.train_loss,
        **evals,
        **nonfinite.figures(),
        **checkpointer.figures(),
    }


def progress_bar(cfg: TrainerConfig, world: dist.World) -> tqdm:
    """The steps' progress bar on rank 0 (trainer.progress); it redraws at most every 30 s when
    stderr is a log file rather than a terminal."""
    return tqdm(
        total=cfg.max_steps,
        disable=not (cfg.progress and world.is_main),
        desc="train",
        dynamic_ncols=True,
        mininterval=0.1 if sys.stderr.isatty() else 30.0,
    )


def _log_train(record: dict | None, *, logger: RunLogger, bar: tqdm) -> None:
    if record is not None:  # None: every step of the window was skipped
        logger.log(record)
        bar.set_postfix(loss=f"{record['train_loss']:.4f}")


def _log_eval(step: int, evals: dict, *, logger: RunLogger, bar: tqdm, world: dist.World) -> None:
    logger.log({"step": step, **evals})
    if world.is_main:
        bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in evals.items()))
