"""One run on this rank: the checks before any process group, then process group, run dir,
data, model under its strategy, optimizer, resume, the training loop, and summary.json however
the run ends. `sdp.train` (the entrypoint) and a sweep's Slurm tasks call `main`."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from sdp import dist, rundir
from sdp.build import build_strategy
from sdp.checkpoint import Checkpoint, Resume, check_resume, choose_checkpoint, load_checkpoint, save_checkpoint
from sdp.config import RunConfig, load_config
from sdp.data import build_data, prepare_data
from sdp.errors import ConfigError, RunFailed
from sdp.metrics.comm import CommCounter
from sdp.metrics.logger import RunLogger
from sdp.optim import build_optimizer, build_scheduler
from sdp.parallel import Strategy
from sdp.redact import redact, redact_text, redact_yaml
from sdp.rundir import Summary
from sdp.trainer import micro_batch_size, train


def run_name(cfg: RunConfig) -> str:
    return cfg.name or f"{cfg.model.name}-{cfg.dataset.name}-{cfg.masking.name}"


# Settings that do not change what a run computes: a resume may change them.
RESUME_MAY_CHANGE = (
    "logger",
    "trainer.progress",
    "trainer.stop_at_step",
    "trainer.checkpoint_every",
    "trainer.keep_checkpoints",
    "trainer.on_nonfinite",
    "trainer.max_nonfinite_skips",
)


def resume_config(raw: DictConfig) -> dict:
    """The resolved config as a resume compares it with the checkpoint's (secrets redacted:
    it is written into every checkpoint's meta.json)."""
    config = redact(OmegaConf.to_container(raw, resolve=True))
    for dotted in RESUME_MAY_CHANGE:
        *path, last = dotted.split(".")
        node = config
        for key in path:
            node = node.get(key, {})
        node.pop(last, None)
    return config


def check_run_dir(cfg: RunConfig, raw: DictConfig, *, world_size: int) -> Resume | None:
    """Before any process group: the checkpoints to resume from when run_dir holds some (and
    the config matches), None for a new run; a completed run, or one that cannot be resumed,
    is refused with one error and nothing written so far is touched.

    A torchrun restart (--max-restarts) of a launch without run_dir finds the run dir its
    first attempt created by the job's rendezvous id (launch.json)."""
    if not cfg.run_dir:
        cfg.run_dir = rundir.elastic_run_dir(cfg.output_root)
        if not cfg.run_dir:
            return None
    run_dir = Path(cfg.run_dir)
    return check_resume(run_dir, resume_config(raw), world_size=world_size, restarted=rundir.restarted_job(run_dir))


class StopSignals:
    """SIGTERM / SIGUSR1 (a scheduler's preemption notice; torchrun passes SIGTERM on to its
    workers) ask the run to checkpoint and stop after the current step."""

    def __init__(self, device: torch.device):
        self.device, self.flag = device, False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.flag = True

    def __call__(self) -> bool:
        """Whether any rank was signalled (collective: every rank agrees)."""
        t = torch.tensor([float(self.flag)], device=self.device)
        return dist.all_reduce_(t, op="max").item() > 0


def calibration_stream(cfg: RunConfig, strategy: Strategy, *, world: dist.World, batch_size: int, start_batch: int = 0):
    """Training batches for BatchNorm recalibration of an assembled model, from a stream of
    their own (another seed), so the training data order is not disturbed; None when unused.
    `start_batch`: batches earlier evaluations of a resumed run took from it."""
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
        start_batch=start_batch,
    )
    return data.train


def pick_checkpoint(resume: Resume | None, *, world: dist.World) -> Checkpoint | None:
    """Collective: the newest intact checkpoint of `resume`; a damaged one is skipped with a
    warning, and a run dir with none intact is refused."""
    if resume is None or not (resume.candidates or resume.problems):
        return None  # a new run, or a restart that died before its first checkpoint
    ckpt, problems = choose_checkpoint(resume, world=world)
    if ckpt is None:
        raise RunFailed(
            f"run_dir holds no intact checkpoint to resume from ({'; '.join(problems)}); "
            "restore the files, or start the run again in a new run_dir"
        )
    for problem in problems:
        dist.warn0(world, f"damaged checkpoint skipped: {problem}")
    if problems:
        dist.warn0(world, f"resuming from {ckpt.path.name}, the newest intact checkpoint")
    return ckpt


def run(raw: DictConfig, cfg: RunConfig, world: dist.World, resume: Resume | None = None) -> dict:
    """Train one configured run on this rank, from the start or from the newest intact
    checkpoint of `resume`; rank 0 writes the run dir."""
    device = dist.select_device(cfg.trainer.device, world, share=cfg.parallelism.backend == "gloo")
    backend = dist.default_backend(device) if cfg.parallelism.backend == "auto" else cfg.parallelism.backend
    dist.init_process_group(world, backend=backend, device=device)
    logger = None
    summary = Summary(
        status="running",
        model=cfg.model.name,
        dataset=cfg.dataset.name,
        world_size=world.world_size,
        coverage=cfg.masking.coverage,
        masking=cfg.masking.name,
        parallelism=cfg.parallelism.name,
        activation_checkpointing=cfg.parallelism.activation_checkpointing,
        mixed_precision=cfg.parallelism.mixed_precision,
        protocol=cfg.trainer.protocol,
        device=device.type,
        seed=cfg.seed,
    )
    run_dir = None
    try:
        ckpt = pick_checkpoint(resume, world=world)
        start_step = ckpt.step if ckpt else 0
        every = cfg.masking.resample_every
        # A checkpoint is taken after the step's resample: it holds the next mask epoch's subnetwork.
        mask_epoch = start_step // every if every else 0
        chosen = rundir.choose_run_dir(run_dir=cfg.run_dir, output_root=cfg.output_root, name=run_name(cfg))
        run_dir = Path(dist.broadcast_object(str(chosen) if world.is_main else None))
        summary.run_dir = str(run_dir)
        if world.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / rundir.CONFIG).write_text(redact_yaml(raw))
            rundir.record_launch(run_dir)  # a torchrun restart without run_dir finds this dir by it
            if resume is not None:  # records of steps after the checkpoint are written again
                rundir.truncate_metrics(run_dir, start_step)
        logger = RunLogger(
            cfg.logger,
            run_dir=run_dir,
            metrics=run_dir / rundir.METRICS,
            run_name=run_name(cfg),
            active=world.is_main,
            config=OmegaConf.to_container(raw, resolve=True),
            resume_id=ckpt.meta.get("wandb_id") if ckpt else None,
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
            start_batch=start_step * cfg.trainer.grad_accum_steps,
        )
        comm = CommCounter(device)
        strategy = build_strategy(cfg, world=world, device=device, comm=comm, mask_epoch=mask_epoch)
        # Initial weights were drawn alike on every rank; from here on each rank draws its own
        # dropout, drop-path and baseline masks.
        torch.manual_seed(cfg.seed + world.rank)
        summary.n_params = strategy.full_params
        summary.strategy.update(strategy.describe())
        optimizer = build_optimizer(strategy.trainable(), cfg.optim, device=device)
        scheduler = build_scheduler(optimizer, cfg.optim, max_steps=cfg.trainer.max_steps)
        measured = None
        if ckpt:
            measured = load_checkpoint(
                ckpt, strategy=strategy, optimizer=optimizer, scheduler=scheduler, world=world, device=device
            )
            dist.print0(world, f"resumed from {ckpt.path} (step {start_step})")
        summary.throughput_unit = "tokens/s" if data.kind == "text" else "samples/s"
        evals_done = start_step // cfg.trainer.eval_every if cfg.trainer.eval_every else 0
        calibration = calibration_stream(
            cfg, strategy, world=world, batch_size=micro, start_batch=evals_done * cfg.masking.bn_recalibration_batches
        )
        config = resume_config(raw)

        def checkpoint(step: int, measured_so_far: dict) -> Path | None:
            return save_checkpoint(
                run_dir,
                step=step,
                strategy=strategy,
                optimizer=optimizer,
                scheduler=scheduler,
                world=world,
                device=device,
                config=config,
                keep=cfg.trainer.keep_checkpoints,
                measured=measured_so_far,
                extra_meta={"wandb_id": logger.wandb_id},
            )

        dist.print0(
            world,
            f"run dir: {run_dir}  ({cfg.model.name}: {summary.n_params / 1e6:.2f}M params, "
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
                model_path=run_dir / rundir.MODEL,
                run_dir=run_dir,
                precision=cfg.parallelism.mixed_precision,
                start_step=start_step,
                measured=measured,
                checkpoint=checkpoint,
                stop_requested=StopSignals(device),
            )
        )
        summary.status = "stopped" if summary.stopped_at else "completed"
        return summary
    except KeyboardInterrupt:
        summary.status = "interrupted"
        raise
    except Exception as err:
        summary.status, summary.error = "failed", f"{type(err).__name__}: {err}"
        raise
    finally:
        if logger is not None:
            if world.is_main:
                rundir.write_summary(run_dir, summary)
            logger.summary(summary.to_json())
            logger.close(exit_code=0 if summary.status == "completed" else 1)
        dist.destroy_process_group()


def main(overrides: list[str]) -> int:
    """Check, then train one run on this rank; the exit code: 0 done, 2 bad input (one line,
    before any process group), 3 a diagnosed failure (one line)."""
    world = dist.world_from_env()
    try:
        raw, cfg = load_config(overrides, world_size=world.world_size, offline=dist.hub_offline())
        resume = check_run_dir(cfg, raw, world_size=world.world_size)
    except ConfigError as err:
        dist.print0(world, f"error: {err}", file=sys.stderr)
        if not world.is_main:
            # Every rank finds the same error, rank 0 reports it: torchrun stops the job when
            # the first rank exits, so the others leave after rank 0 has had time to print.
            time.sleep(2)
        return 2
    try:
        summary = run(raw, cfg, world, resume=resume)
    except RunFailed as err:  # diagnosed (and in summary.json once it exists): one line, no traceback
        dist.print0(world, redact_text(f"error: {err}"), file=sys.stderr)
        return 3
    if world.is_main:
        print_result(summary)
    return 0


def print_result(summary: Summary) -> None:
    """A short human-readable result line block for the terminal."""
    mem = summary.memory
    values = {"train_loss": summary.train_loss, "eval_loss": summary.eval_loss, "eval_acc": summary.eval_acc}
    quality = " ".join(f"{k}={v:.4f}" for k, v in values.items() if v is not None)
    speed = summary.tokens_or_samples_per_s
    speed = "" if speed is None else f"{speed:.1f} {summary.throughput_unit}, "
    peak = "" if mem["peak_bytes"] is None else f", live peak {mem['peak_bytes'] / 2**20:.1f} MiB/rank"
    verb = "stopped" if summary.stopped_at else "done"
    print(
        f"{verb}: {summary.steps} steps, {quality}, {speed}"
        f"params+grads+optim {summary.static_bytes / 2**20:.1f} MiB/rank{peak}, "
        f"comm {summary.comm_bytes_per_step / 2**20:.2f} MiB/step -> {summary.run_dir}",
        flush=True,
    )
