"""trainer.*: the training loop's settings, and the checks on them. The loop's parts (the meter,
the NaN/Inf policy, the checkpointer, the evaluation) are each made from this config by their
own `from_config`; it sits below them all, so that each can read it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from sdp.errors import ConfigError


class OnNonFinite(StrEnum):
    """trainer.on_nonfinite: stop the run, skip the step, or off (no check)."""

    stop = "stop"
    skip = "skip"
    off = "off"


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
    # The convergence gate (sdp.metrics.convergence): the run has converged when its smoothed eval
    # metric moved by less than this (relative) over the last 20% of its steps.
    plateau_threshold: float = 0.005
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
    if not 0 < cfg.plateau_threshold < 1:
        raise ConfigError("trainer.plateau_threshold", cfg.plateau_threshold, "must be in (0, 1): a relative change")
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
