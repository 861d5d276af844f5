"""The training loop: step, periodic evaluation, metrics."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from sdp import dist
from sdp.data import DataBundle
from sdp.data.prefetch import to_device
from sdp.errors import Interrupted, WriteFailed
from sdp.metrics.logger import RunLogger
from sdp.outer.loop import OuterLoop
from sdp.parallel import Strategy
from sdp.run.checkpoint import Checkpointer
from sdp.run.measure import Meter, PhaseTimer
from sdp.run.nonfinite import NonFiniteGuard, NonFinitePolicy, NonFiniteStep, check_finite
from sdp.run.trainer_config import TrainerConfig, micro_batch_size
from sdp.rundir import MODEL, write_error


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
    average them over ranks so that every rank evaluates the same model. Only the norms run in
    training mode: the statistics are those of the model as evaluated (no dropout, no dropped
    units or blocks)."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms or count == 0:
        return
    states = [(m.momentum, m.training) for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
        m.train()
    for _ in range(count):
        model(_to_device(next(batches), device)["inputs"])
    for m, (momentum, training) in zip(norms, states, strict=True):
        m.momentum = momentum
        m.train(training)
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
    shard, after BatchNorm recalibration from `calibration` (masking.bn_recalibration_batches);
    the final one also writes that model to `model_path` (None: not saved)."""

    data: DataBundle
    device: torch.device
    world: dist.World
    calibration: Iterator[dict] | None = None
    calibration_batches: int = 0
    model_path: Path | None = None

    @classmethod
    def from_config(
        cls,
        cfg: TrainerConfig,
        *,
        data: DataBundle,
        device: torch.device,
        world: dist.World,
        run_dir: Path,
        calibration: Iterator[dict] | None,
        calibration_batches: int,
    ) -> Evaluation:
        """The final evaluation writes RUN_DIR/model.pt with trainer.save_model."""
        model_path = run_dir / MODEL if cfg.save_model else None
        return cls(data, device, world, calibration, calibration_batches, model_path)

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


@dataclass
class Loop:
    """What the training loop drives, each part made from the typed config by its own
    constructor (`sdp.run.runner` wires them): the model under its strategy, the data, the
    optimizer and its lr schedule, and the parts that keep their own timing: the meter, the
    NaN/Inf policy, the checkpointer, the evaluations; the logger; the outer loop's syncs
    (outer=diloco; None: the strategy averages every step)."""

    strategy: Strategy
    data: DataBundle
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    meter: Meter
    nonfinite: NonFinitePolicy
    checkpointer: Checkpointer
    evaluation: Evaluation
    logger: RunLogger
    outer: OuterLoop | None = None

    def synced(self):
        """Context: the model holds the last synced weights (an outer loop's theta_prev; the
        model as it is without one): what evaluation sees between syncs."""
        return self.outer.synced() if self.outer is not None else contextlib.nullcontext()


def train(
    loop: Loop,
    cfg: TrainerConfig,
    *,
    world: dist.World,
    start_step: int = 0,
    stop_requested: Callable[[], bool] | None = None,
) -> dict:
    """Run optimizer steps start_step + 1 ... cfg.max_steps; returns the loop's entries of
    summary.json. The host waits for the device only at log, eval and checkpoint steps. A run
    stops early, with a checkpoint, at cfg.stop_at_step or when `stop_requested()` (collective,
    read at log steps) says so."""
    bar = progress_bar(cfg, world)
    loop.strategy.model.train()
    run_step = _step_runner(loop, cfg, world=world)
    stopped_at, evals, done = None, {}, start_step
    try:
        bar.update(start_step)
        for step in range(start_step + 1, cfg.max_steps + 1):
            done = step - 1
            lr = _optimizer_step(loop, run_step, step=step, max_steps=cfg.max_steps)
            bar.update(1)
            log_step = step % cfg.log_every == 0 or step == cfg.max_steps
            eval_step = (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.max_steps
            stopping = step < cfg.max_steps and (
                step == cfg.stop_at_step or (log_step and stop_requested is not None and stop_requested())
            )
            if not (log_step or eval_step or loop.checkpointer.due(step) or stopping):
                continue  # no host sync in this step
            loop.meter.sync()  # the host waits for the device here
            loop.nonfinite.report(found_at=step, last_checkpoint=loop.checkpointer.last)
            if log_step or stopping:
                _log_train(loop.meter.window(step, lr), logger=loop.logger, bar=bar)
            if eval_step:
                with loop.synced():
                    evals = loop.evaluation(loop.strategy, final=step == cfg.max_steps)
                _log_eval(step, evals, logger=loop.logger, bar=bar, world=world)
            if loop.checkpointer.due(step) or stopping:
                loop.checkpointer.save(step, loop.meter.measured())
            if stopping:
                stopped_at = step
                break
    except KeyboardInterrupt:  # a second Ctrl-C: the steps done so far, and where a resume starts
        raise Interrupted(done, loop.checkpointer.last) from None
    finally:  # the bar ends its line before anything else is printed
        bar.close()
    return {
        "steps": stopped_at or cfg.max_steps,
        "stopped_at": stopped_at,
        "resumes_from": loop.checkpointer.last if stopped_at else None,
        "resumed_from": start_step or None,
        "train_loss": loop.meter.train_loss,
        **evals,
        **loop.nonfinite.figures(),
        **loop.checkpointer.figures(),
    }


def _step_runner(loop: Loop, cfg: TrainerConfig, *, world: dist.World) -> Callable[[], torch.Tensor]:
    """One optimizer step of `train_step` over the loop's batches, on the meter's device."""
    micro, device = micro_batch_size(cfg, world_size=world.world_size), loop.meter.device
    batches = to_device(loop.data.train, device)

    def run_step() -> torch.Tensor:
        return train_step(
            loop.strategy,
            loop.optimizer,
            batches,
            cfg=cfg,
            micro=micro,
            device=device,
            timer=loop.meter.timer,
            guard=loop.nonfinite.guard,
        )

    return run_step


def _optimizer_step(loop: Loop, run_step: Callable[[], torch.Tensor], *, step: int, max_steps: int) -> float:
    """Step `step`, measured; a NaN/Inf step handled by the policy (the model stays the last good
    one); the schedule advanced; an outer sync and a new mask where one is due. Returns the lr
    the step used."""
    try:
        loop.meter.add_loss(loop.meter.run(step, run_step), loop.nonfinite.applied())
    except NonFiniteStep as bad:  # raised on every rank before the update: the model is the last good one
        loop.nonfinite.raised(bad, step=step, last_checkpoint=loop.checkpointer.last)
        loop.optimizer.zero_grad(set_to_none=True)
    lr = loop.scheduler.get_last_lr()[0]  # the lr this step used
    loop.scheduler.step()
    if loop.outer is not None:  # the outer algorithm's sync where one is due, in this step's time and bytes
        with loop.meter.outer_syncs(step):
            loop.outer.after_step(step)
    resampled = step < max_steps and loop.strategy.resample(step, loop.optimizer)
    if resampled:
        loop.strategy.model.train()
    loop.meter.end(step, resampled=resampled)
    return lr


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
