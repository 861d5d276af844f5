"""The training loop: step, periodic evaluation, metrics."""

from __future__ import annotations

import contextlib
import functools
import sys
import time
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
from sdp.errors import ConfigError
from sdp.metrics.comm import CommCounter, exposed_comm
from sdp.metrics.flops import attention_heads, flop_counter, model_flops_per_token, peak_entry
from sdp.metrics.logger import RunLogger
from sdp.metrics.memory import LivePeak, cuda_peaks
from sdp.nonfinite import POLICIES, NonFiniteGuard, NonFiniteStep, check_finite, handle_nonfinite, skips_on_device
from sdp.parallel import Strategy

PROTOCOLS = ("same_iteration", "flop_matched")


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
    protocol: str = "same_iteration"
    # A step whose loss or gradient is NaN/Inf on any rank (checked after the gradient sync,
    # before the update; see sdp.nonfinite): stop (write nonfinite_step_N.json and fail,
    # keeping the last good checkpoint), skip (drop the update; stop after max_nonfinite_skips
    # such steps) or off (no check: saves a 2-element all-reduce per step).
    on_nonfinite: str = "stop"
    max_nonfinite_skips: int = 10


def validate_trainer(cfg: TrainerConfig, *, world_size: int) -> None:
    """Check the loop's settings, including that the global batch splits evenly."""
    for key in ("max_steps", "global_batch_size", "grad_accum_steps", "log_every"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"trainer.{key}", getattr(cfg, key), "must be >= 1")
    for key in ("checkpoint_every", "stop_at_step"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"trainer.{key}", getattr(cfg, key), "must be >= 0 (0: off)")
    if cfg.protocol not in PROTOCOLS:
        raise ConfigError("trainer.protocol", cfg.protocol, f"allowed: {', '.join(PROTOCOLS)}")
    if cfg.on_nonfinite not in POLICIES:
        raise ConfigError("trainer.on_nonfinite", cfg.on_nonfinite, f"allowed: {', '.join(POLICIES)}")
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
        if export is not None:
            state = strategy.plain_state_dict(full)
            if write_export:
                torch.save(state, export)
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


PHASES = ("data", "forward", "backward", "sync", "optimizer")


class PhaseTimer:
    """Time per phase of a step, without making the host wait for the device. On CUDA each
    compute phase is timed by two CUDA events on the compute stream, read at `read()` (where
    the host syncs anyway): the device's time from the phase's first kernel to its last, so
    DDP's all-reduce, which overlaps the backward, counts there, and collectives still running
    on NCCL's streams (SDP's overlapped averaging) count where the compute waits for them. The
    data phase is the host's wait for a batch; on CPU every phase is wall time. Phases run
    while `active` is false (profiled steps) are not counted."""

    def __init__(self, device: torch.device):
        self.device = device
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.active = True
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if self.device.type == "cuda" and phase != "data":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            if self.active:
                self._events.append((phase, start, end))
            return
        t0 = time.perf_counter()
        yield
        if self.active:
            self.totals[phase] += time.perf_counter() - t0

    def read(self) -> dict[str, float]:
        """Seconds per phase so far (waits for the phases the device has still to finish)."""
        for phase, start, end in self._events:
            end.synchronize()
            self.totals[phase] += start.elapsed_time(end) / 1000
        self._events.clear()
        return dict(self.totals)


class StepClock:
    """Wall time of the timed steps, counted in windows that end where the host waits for the
    device anyway (log, eval and checkpoint steps, profiled steps): the steps in between
    run without a host sync, the host queueing work ahead of the device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds, self.steps = 0.0, 0
        self._since: float | None = None
        self._pending = 0

    def begin(self, *, timed: bool) -> None:
        """Before a step: a timed one runs in the open window (one is opened if none is); an
        untimed one outside any (the window is closed, after waiting for the device)."""
        if not timed:
            self.stop()
        elif self._since is None:
            self._since = time.perf_counter()

    def end(self, *, timed: bool) -> None:
        """After a step: a timed one is counted in its window; after an untimed one the device
        is waited for, so that none of its work runs into the next window."""
        if timed:
            self._pending += 1
        else:
            self.stop()

    def stop(self) -> None:
        """Wait for the device, and close the open window."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self._since is not None:
            self.seconds += time.perf_counter() - self._since
            self.steps += self._pending
        self._since, self._pending = None, 0

    def step_time(self) -> float | None:
        return self.seconds / self.steps if self.steps else None


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
    (a fused optimizer, see sdp.nonfinite), else on the host, raising NonFiniteStep. The
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


def count_flops(run_step) -> tuple[torch.Tensor, int]:
    """Run `run_step()` under the FLOP counter; returns its loss and the FLOPs it ran.

    Not in the same step as `measure_peak`: the counter's module tracking keeps the
    tensors a checkpointed block recomputes alive, which would inflate the peak. Compiled
    blocks run eagerly in it (dynamo cannot trace under a dispatch mode)."""
    with torch.compiler.set_stance("force_eager"), flop_counter() as flops:
        loss = run_step()
    return loss, int(flops.get_total_flops())


def measure_peak(strategy: Strategy, optimizer: torch.optim.Optimizer, run_step) -> tuple[torch.Tensor, dict]:
    """Run `run_step()` under the live-tensor tracker; returns its loss and the peak by kind.

    Call it after at least one step, so the optimizer state and the last
    gradients exist and are registered as live when the tracker starts. Compiled blocks run
    eagerly in it (dynamo cannot trace under a dispatch mode): the peak of the eager step,
    an upper bound of the compiled one's (whose CUDA peak is `cuda_max_allocated_bytes`).
    """
    with torch.compiler.set_stance("force_eager"), LivePeak(strategy.model, optimizer) as peak:
        loss = run_step()
    return loss, peak.breakdown()


def profile_steps(cfg: TrainerConfig) -> tuple[int, int]:
    """(the step whose FLOPs are counted, the step whose live peak is measured); 0: none.

    Absolute step numbers: a resumed run profiles the same steps as an uninterrupted one
    (the FLOP counter changes the kernels' rounding) and keeps the measurements that
    the launch before it made."""
    if not cfg.profile_step:
        return 0, 0
    peak_step = min(cfg.profile_step, cfg.max_steps)
    flop_step = peak_step - 1 if peak_step > 1 else 2
    return (flop_step if flop_step <= cfg.max_steps else 0), peak_step


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
    run_dir: Path | None = None,
    precision: str = "fp32",
    start_step: int = 0,
    measured: dict | None = None,
    checkpoint: Callable[[int, dict], None] | None = None,
    stop_requested: Callable[[], bool] | None = None,
) -> dict:
    """Run optimizer steps start_step + 1 ... cfg.max_steps; returns the loop's part of `summary.json`.

    `units_per_sample` is tokens per sequence for LMs and 1 for images, so the
    throughput reads as tokens/s or samples/s. `checkpoint(step, measured)` (collective)
    saves a resumable state, with this rank's measurements so far, every
    cfg.checkpoint_every steps and before an early stop: at cfg.stop_at_step, or when
    `stop_requested()` (collective, every rank agrees) says so. `measured` is what the
    launch before a resume had measured on this rank.
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
    strategy.model.train()
    timer, clock = PhaseTimer(device), StepClock(device)
    # The loss summed over this log window's applied steps, and their number, on the device.
    window_loss, window_applied = torch.zeros((), device=device), torch.zeros((), device=device)
    measured = measured or {}
    memory, measure_memory, last = measured.get("memory", {}), True, {}
    peak, flops = measured.get("peak"), measured.get("flops")
    flop_step, peak_step = profile_steps(cfg)
    stopped_at, checkpoint_failures, written, last_checkpoint = None, 0, True, start_step or None
    checkpoints_written, checkpoint_time = 0, 0.0
    evals: dict = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    guard = None
    if cfg.on_nonfinite != "off" and skips_on_device(optimizer):
        guard = NonFiniteGuard(
            cfg.on_nonfinite, max_skips=cfg.max_nonfinite_skips, device=device, first_step=start_step + 1
        )
    batches = to_device(data.train, device)

    def run_step() -> torch.Tensor:
        return train_step(strategy, optimizer, batches, cfg=cfg, micro=micro, device=device, timer=timer, guard=guard)

    skipped: list[int] = []

    nonfinite = functools.partial(
        handle_nonfinite,
        policy=cfg.on_nonfinite,
        max_skips=cfg.max_nonfinite_skips,
        skipped=skipped,
        world=world,
        logger=logger,
        run_dir=run_dir,
    )

    try:
        bar.update(start_step)
        for step in range(start_step + 1, cfg.max_steps + 1):
            # Left out of the timings: the profiled steps (the counters slow them down), and a
            # compiled model's first step (its compilation).
            untimed = step in (flop_step, peak_step) or (strategy.compiled and step == start_step + 1)
            clock.begin(timed=not untimed)
            timer.active = not untimed
            try:
                if step == flop_step:
                    loss, flops = count_flops(run_step)
                elif step == peak_step:
                    loss, peak = measure_peak(strategy, optimizer, run_step)
                else:
                    loss = run_step()
            except NonFiniteStep as bad:
                # Every rank raised it, before the update: the model is still the last good one.
                loss = None
                nonfinite(bad, step=step, found_at=step, last_checkpoint=last_checkpoint)
                optimizer.zero_grad(set_to_none=True)
            if loss is not None:
                applied = torch.ones((), device=device) if guard is None else 1 - guard.last_skip
                window_loss += torch.where(applied > 0, loss, 0.0)
                window_applied += applied
            lr = scheduler.get_last_lr()[0]  # the lr this step used
            scheduler.step()
            resampled = step < cfg.max_steps and strategy.resample(step, optimizer)
            if resampled:
                strategy.model.train()
            comm.end_step(timed=not untimed)
            clock.end(timed=not untimed)
            if measure_memory:  # gradients and optimizer state exist from the first step on
                memory = _elementwise_max(memory, strategy.memory(optimizer))
            measure_memory = resampled  # a new subnetwork: measure it after its first step
            bar.update(1)
            log_step = step % cfg.log_every == 0 or step == cfg.max_steps
            eval_step = (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.max_steps
            periodic = cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.max_steps
            # Stop signals are read at log steps (a collective read on the host).
            stopping = step < cfg.max_steps and (
                step == cfg.stop_at_step or (log_step and stop_requested is not None and stop_requested())
            )
            if not (log_step or eval_step or periodic or stopping):
                continue  # no host sync in this step
            clock.stop()  # the host waits for the device here
            if guard is not None:
                for at, bad in guard.report():
                    nonfinite(bad, step=at, found_at=step, last_checkpoint=last_checkpoint)

            if log_step or stopping:
                record = _log_window(step, lr, window_loss, window_applied, clock=clock, units_per_step=units_per_step)
                if record is not None:  # None: every step of the window was skipped
                    last = record
                    logger.log(last)
                    bar.set_postfix(loss=f"{last['train_loss']:.4f}")
                window_loss.zero_()
                window_applied.zero_()
            if eval_step:
                final = step == cfg.max_steps and cfg.save_model
                evals = evaluate(
                    strategy,
                    data,
                    device=device,
                    calibration=calibration,
                    calibration_batches=calibration_batches,
                    export=model_path if final else None,
                    write_export=world.is_main,
                )
                logger.log({"step": step, **evals})
                if world.is_main:
                    bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in evals.items()))
            if checkpoint is not None and (periodic or stopping):
                t_ckpt = time.perf_counter()
                written = checkpoint(step, {"memory": memory, "peak": peak, "flops": flops})
                checkpoint_time += time.perf_counter() - t_ckpt
                checkpoints_written += bool(written)
                checkpoint_failures += not written
                last_checkpoint = step if written else last_checkpoint
            if stopping:
                stopped_at = step
                if world.is_main:
                    where = "its checkpoint" if written else "the checkpoint before (this one could not be written)"
                    bar.write(f"stopped after step {step}; the same command resumes from {where}")
                break
    finally:  # the bar ends its line before anything else is printed
        bar.close()
    speed = _speed(clock, timer, units_per_step=units_per_step, world_size=world.world_size)
    return {
        "steps": stopped_at or cfg.max_steps,
        "stopped_at": stopped_at,
        "resumed_from": start_step or None,
        "train_loss": last.get("train_loss"),
        "nonfinite_skipped_steps": skipped,
        "checkpoint_failures": checkpoint_failures,
        # Wall time of this launch's checkpoints (written, checksummed, fsynced), outside the step times.
        "checkpoints_written": checkpoints_written,
        "checkpoint_time_s": checkpoint_time,
        **evals,
        **speed,
        **_measurements(strategy, comm, memory=memory, peak=peak, flops=flops, device=device),
        **_mfu(
            strategy,
            device=device,
            precision=precision,
            flops=flops,
            step_time=speed["step_time_s"],
            tokens_per_rank=units_per_step // world.world_size,
            seq_len=units_per_sample,
        ),
    }


def _speed(clock: StepClock, timer: PhaseTimer, *, units_per_step: int, world_size: int) -> dict:
    """summary.json's throughput and step times (per rank: its share of the global batch)."""
    step_time = clock.step_time()
    return {
        "tokens_or_samples_per_s": units_per_step / step_time if step_time else None,
        "tokens_or_samples_per_s_per_rank": units_per_step / world_size / step_time if step_time else None,
        "step_time_s": step_time,
        "step_time_split_s": {k: v / clock.steps for k, v in timer.read().items()} if clock.steps else {},
    }


def _measurements(
    strategy: Strategy, comm: CommCounter, *, memory: dict, peak: dict | None, flops: int | None, device: torch.device
) -> dict:
    """Collective: summary.json's memory, FLOP and communication entries, from every rank's."""
    local = {
        **memory,
        "peak_bytes": peak["total"] if peak else None,
        "peak_breakdown": peak,
        **cuda_peaks(device),
    }
    gathered = dist.gather_objects((local, flops, comm.waits()))
    per_rank = [mem for mem, _, _ in gathered]
    return {
        "flops_per_step_per_rank": max((f for _, f, _ in gathered if f is not None), default=None),
        "memory": _busiest(per_rank),
        "memory_per_rank": per_rank,
        **_comm_summary(comm, strategy, [w for _, _, w in gathered], device=device),
    }


def _mfu(
    strategy: Strategy,
    *,
    device: torch.device,
    precision: str,
    flops: int | None,
    step_time: float | None,
    tokens_per_rank: int,
    seq_len: int,
) -> dict:
    """summary.json's MFU entries: the FLOPs a step of this rank is credited with (a
    transformer's model FLOPs by torchtitan's formula for what this rank runs, see
    metrics.flops.model_flops_per_token; other models' FLOPs as counted in the profiled step)
    over its step time and the peak-table entry of the device (`mfu_peak`; null on CPU or an
    unlisted device, and then `mfu` is null too)."""
    peak = peak_entry(device, precision)
    out = {"mfu": None, "mfu_peak": peak, "mfu_flops": None, "mfu_flops_per_step": None}
    heads, head_dim = attention_heads(strategy.model)
    if heads:
        trainable = strategy.trainable()
        embeddings = [m.weight for m in strategy.model.modules() if isinstance(m, nn.Embedding)]
        embedding = sum(w.numel() for w in embeddings)
        trained = sum(p.numel() for p in trainable) - sum(
            w.numel() for w in embeddings if any(w is p for p in trainable)
        )
        per_token = model_flops_per_token(
            forward_params=strategy.forward_params() - embedding,
            trained_params=trained,
            heads=heads,
            head_dim=head_dim,
            seq_len=seq_len,
        )
        out["mfu_flops"], out["mfu_flops_per_step"] = "model (torchtitan)", per_token * tokens_per_rank
    elif flops:
        out["mfu_flops"], out["mfu_flops_per_step"] = "counted", flops
    if peak and step_time and out["mfu_flops_per_step"]:
        out["mfu"] = out["mfu_flops_per_step"] / step_time / peak["flops_per_s"]
    return out


def _log_window(
    step: int, lr: float, loss_sum: torch.Tensor, applied: torch.Tensor, *, clock: StepClock, units_per_step: int
) -> dict | None:
    """Collective: the log record of a window, its mean train loss over every rank's applied
    steps and the throughput so far; None when every step of the window was skipped."""
    total, count = dist.all_reduce_(torch.stack([loss_sum, applied])).tolist()
    if count == 0:
        return None
    record = {"step": step, "train_loss": total / count, "lr": lr}
    if clock.steps:
        record["tokens_or_samples_per_s"] = units_per_step * clock.steps / clock.seconds
        record["step_time_s"] = clock.seconds / clock.steps
    return record


def _comm_summary(comm: CommCounter, strategy: Strategy, waits: list, *, device: torch.device) -> dict:
    """summary.json's communication entries, from every rank's counter (collective); `waits`
    is every rank's `comm.waits()`."""
    per_step = comm.per_step()
    counters = {**per_step, "total": sum(per_step.values()), "comm_groups": strategy.comm_groups()}
    busiest = _max_over_ranks(counters, device=device)
    exposed, waited = exposed_comm(waits)
    return {
        # The busiest rank's total, and each kind's busiest rank (not necessarily the same one).
        "comm_bytes_per_step": busiest.pop("total"),
        # The busiest rank's process groups (with NCCL, communicators), the world included.
        "comm_groups_per_rank": int(busiest.pop("comm_groups")),
        "comm_bytes_per_step_by_kind": busiest,
        # Waiting for gradient averaging and weight refresh after the compute, mean s per step:
        # the part no rank could hide, and the busiest rank's, peers' drift included (see
        # metrics.comm.exposed_comm; None where not measured: FSDP waits inside its own hooks).
        "exposed_comm_s": exposed,
        "comm_wait_s": waited,
    }


def _busiest(per_rank: list[dict]) -> dict:
    """Each memory counter's largest value over the ranks, and the peak breakdown of the rank
    with the largest live peak."""
    out = {}
    for key in per_rank[0]:
        if key == "peak_breakdown":
            continue
        values = [r[key] for r in per_rank if r[key] is not None]
        out[key] = max(values) if values else None
    with_peak = [r for r in per_rank if r["peak_breakdown"] is not None]
    out["peak_breakdown"] = max(with_peak, key=lambda r: r["peak_bytes"])["peak_breakdown"] if with_peak else None
    return out


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
