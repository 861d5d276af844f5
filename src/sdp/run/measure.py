"""Measuring a run without making the host wait for the device: phase timers (CUDA events),
the step clock, the loss window, the profiled steps (FLOPs, live-tensor peak) and the static
bytes per rank; `Meter` decides when each runs and hands its figures to the summary."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from sdp import dist
from sdp.metrics.comm import CommCounter
from sdp.metrics.flops import flop_counter
from sdp.metrics.memory import LivePeak
from sdp.outer.loop import OuterLoop
from sdp.parallel import Strategy
from sdp.run.trainer_config import TrainerConfig
from sdp.rundir import figures

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


def count_flops(run_step) -> tuple[torch.Tensor, int]:
    """Run `run_step()` under the FLOP counter; returns its loss and the FLOPs it ran.

    A run counts in its own step, before `measure_peak`'s; the counter changes nothing a step
    keeps alive (`sdp.metrics.flops.FlopTally`), so the estimator counts both in one. Compiled
    blocks run eagerly in it (dynamo cannot trace under a dispatch mode)."""
    with torch.compiler.set_stance("force_eager"), flop_counter() as flops:
        loss = run_step()
    return loss, int(flops.get_total_flops())


def measure_peak(
    strategy: Strategy, optimizer: torch.optim.Optimizer, run_step, extra_state=()
) -> tuple[torch.Tensor, dict]:
    """Run `run_step()` under the live-tensor tracker; returns its loss and the peak by kind
    (`extra_state`: see `LivePeak`).

    Call it after at least one step, so the optimizer state and the last
    gradients exist and are registered as live when the tracker starts. Compiled blocks run
    eagerly in it (dynamo cannot trace under a dispatch mode): the peak of the eager step,
    an upper bound of the compiled one's (whose CUDA peak is `cuda_max_allocated_bytes`).
    """
    with torch.compiler.set_stance("force_eager"), LivePeak(strategy.model, optimizer, extra_state) as peak:
        loss = run_step()
    return loss, peak.breakdown()


def profile_steps(profile_step: int, max_steps: int) -> tuple[int, int]:
    """(the step whose FLOPs are counted, the step whose live peak is measured); 0: none.

    Absolute step numbers: a resumed run profiles the same steps as an uninterrupted one
    (the FLOP counter changes the kernels' rounding) and keeps the measurements that
    the launch before it made."""
    if not profile_step:
        return 0, 0
    peak_step = min(profile_step, max_steps)
    flop_step = peak_step - 1 if peak_step > 1 else 2
    return (flop_step if flop_step <= max_steps else 0), peak_step


def log_window(
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


class Meter:
    """What the training loop measures, and when: the phase timer and the step clock (timed
    steps only), the loss window of the log steps (on the device), the profiled steps (FLOPs
    counted on one, the live-tensor peak on the next) and the static bytes per rank (after the
    first step and after every resample). `measured` is what the launch before a resume had
    measured on this rank; `measured()` is what a checkpoint keeps for the next."""

    def __init__(
        self,
        strategy: Strategy,
        optimizer: torch.optim.Optimizer,
        *,
        device: torch.device,
        comm: CommCounter,
        profile_step: int,
        max_steps: int,
        start_step: int,
        units_per_step: int,
        measured: dict | None = None,
        outer: OuterLoop | None = None,
    ):
        """`outer`: an outer loop, whose state is counted with the strategy's and whose first sync
        at or after the peak step is measured under the live-tensor tracker too (`sync_peak`)."""
        self.strategy, self.optimizer, self.device, self.comm = strategy, optimizer, device, comm
        self.outer = outer
        self.timer, self.clock = PhaseTimer(device), StepClock(device)
        self.units_per_step = units_per_step
        # The loss summed over this log window's applied steps, and their number, on the device.
        self.loss_sum, self.applied = torch.zeros((), device=device), torch.zeros((), device=device)
        self.train_loss: float | None = None  # the last logged window's
        measured = measured or {}
        self.memory, self.peak, self.flops = measured.get("memory", {}), measured.get("peak"), measured.get("flops")
        self.sync_peak = measured.get("sync_peak")
        self._measure_memory = True  # gradients and optimizer state exist from the first step on
        self.flop_step, self.peak_step = profile_steps(profile_step, max_steps)
        self.sync_step = outer.first_sync(self.peak_step) if outer is not None and self.peak_step else None
        self.first_step = start_step + 1
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    @classmethod
    def from_config(
        cls,
        cfg: TrainerConfig,
        *,
        strategy: Strategy,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        comm: CommCounter,
        start_step: int,
        seq_len: int,
        measured: dict | None,
        outer: OuterLoop | None = None,
    ) -> Meter:
        """The loop's meter: trainer.profile_step of trainer.max_steps, each step's global batch of
        samples (or of `seq_len` tokens each) the unit of its throughput."""
        return cls(
            strategy,
            optimizer,
            device=device,
            comm=comm,
            profile_step=cfg.profile_step,
            max_steps=cfg.max_steps,
            start_step=start_step,
            units_per_step=cfg.global_batch_size * seq_len,
            measured=measured,
            outer=outer,
        )

    def timed(self, step: int) -> bool:
        """Left out of the timings: the profiled steps (the counters slow them down), and a
        compiled model's first step (its compilation)."""
        first_compiled = self.strategy.compiled and step == self.first_step
        return not (step in (self.flop_step, self.peak_step, self.sync_step) or first_compiled)

    def run(self, step: int, run_step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run one step, under the FLOP counter or the live-tensor tracker on the profiled steps."""
        timed = self.timed(step)
        self.clock.begin(timed=timed)
        self.timer.active = timed
        if step == self.flop_step:
            loss, self.flops = count_flops(run_step)
        elif step == self.peak_step:
            extra = self.outer.device_state() if self.outer is not None else ()
            loss, self.peak = measure_peak(self.strategy, self.optimizer, run_step, extra)
        else:
            loss = run_step()
        return loss

    def add_loss(self, loss: torch.Tensor, applied: torch.Tensor) -> None:
        """Count a step's loss in the window if its update was applied (`applied`: 0 or 1, on the device)."""
        self.loss_sum += torch.where(applied > 0, loss, 0.0)
        self.applied += applied

    def end(self, step: int, *, resampled: bool) -> None:
        """After a step (and its resample): close its timings, and measure the bytes per rank
        after the first step and after a resample's (a new subnetwork's) first step."""
        timed = self.timed(step)
        self.comm.end_step(timed=timed)
        self.clock.end(timed=timed)
        if self._measure_memory:
            held = self.strategy.memory(self.optimizer)
            held.update(self.outer.memory() if self.outer is not None else {})
            self.memory = _elementwise_max(self.memory, held)
        self._measure_memory = resampled

    def sync(self) -> None:
        """Where the host waits for the device anyway (log, eval, checkpoint steps): close the window."""
        self.clock.stop()

    def window(self, step: int, lr: float) -> dict | None:
        """Collective: the log record of the window since the last one (None when every step of it
        was skipped), and a new window."""
        record = log_window(step, lr, self.loss_sum, self.applied, clock=self.clock, units_per_step=self.units_per_step)
        if record is not None:
            self.train_loss = record["train_loss"]
        self.loss_sum.zero_()
        self.applied.zero_()
        return record

    @contextlib.contextmanager
    def outer_syncs(self, step: int):
        """Around the outer algorithm's work after optimizer step `step`, which the trainer runs
        inside: the first sync at or after the peak step is run under the live-tensor tracker,
        its peak kept in `sync_peak`; any other step is not measured apart."""
        if step != self.sync_step:
            yield
            return
        extra = self.outer.device_state()
        with torch.compiler.set_stance("force_eager"), LivePeak(self.strategy.model, self.optimizer, extra) as live:
            yield
        self.sync_peak = live.breakdown()

    def _memory(self) -> dict:
        """The static bytes, and an outer sync's live peak where one was measured."""
        return {**self.memory, **({"sync_peak_bytes": self.sync_peak["total"]} if self.sync_peak else {})}

    def measured(self) -> dict:
        return {"memory": self.memory, "peak": self.peak, "flops": self.flops, "sync_peak": self.sync_peak}

    def figures(self, *, world_size: int, precision: str, seq_len: int) -> dict:
        """Collective: the run's speed, memory, FLOP, communication and MFU entries of summary.json."""
        clock = self.clock
        out = figures.speed(
            seconds=clock.seconds,
            steps=clock.steps,
            phases=self.timer.read(),
            units_per_step=self.units_per_step,
            world_size=world_size,
        )
        out.update(
            figures.measurements(
                self.strategy, self.comm, memory=self._memory(), peak=self.peak, flops=self.flops, device=self.device
            )
        )
        mfu = figures.mfu_entries(
            self.strategy,
            device=self.device,
            precision=precision,
            flops=self.flops,
            step_time=out["step_time_s"],
            tokens_per_rank=self.units_per_step // world_size,
            seq_len=seq_len,
        )
        return {**out, **mfu}


def _elementwise_max(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: max(a.get(k, v), v) for k, v in b.items()}
