"""One run on this rank: its checks (`preflight`), then process group, run dir, data, model
under its strategy, optimizer, resume, the training loop (stopped by `signals`), and how the
run ends (`outcome`: summary.json, the export, the one line). `sdp.train` (the entrypoint) and
a sweep's Slurm tasks call `main`."""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sdp import dist, rundir
from sdp.data import DataBundle, build_data, prepare_data
from sdp.errors import ConfigError, Interrupted, PeerLost, RunFailed
from sdp.metrics.comm import CommCounter
from sdp.metrics.convergence import gate_metric, plateau
from sdp.metrics.logger import RunLogger
from sdp.optim import build_optimizer, build_scheduler
from sdp.outer import check_resize, is_outer
from sdp.outer.algorithms import algorithm_of
from sdp.outer.loop import OuterLoop
from sdp.outer.view import view_of
from sdp.parallel import Strategy
from sdp.redact import redact_text
from sdp.run.build import build_strategy
from sdp.run.checkpoint import Checkpoint, Checkpointer, CheckpointTarget, SavedState
from sdp.run.config import RunConfig, record_yaml
from sdp.run.measure import Meter
from sdp.run.nonfinite import NonFinitePolicy
from sdp.run.outcome import export_model, peer_lost, print_result, resume_hint, save_summary, write_failure
from sdp.run.preflight import Checked, preflight
from sdp.run.resume import Resume, choose_checkpoint, config_edits, load_checkpoint
from sdp.run.signals import StopSignals
from sdp.run.trainer import Evaluation, Loop, train
from sdp.run.trainer_config import micro_batch_size
from sdp.rundir import Summary, variant_label


def run_name(cfg: RunConfig) -> str:
    return cfg.name or f"{cfg.model.name}-{cfg.dataset.name}-{cfg.masking.name}"


def pivot_keys(cfg: RunConfig) -> dict:
    """What the tables' rows are keyed by, as top-level keys of W&B's config (its table pivots on them)."""
    variant = variant_label(
        cfg.masking.name,
        granularity=cfg.masking.granularity,
        parallelism=cfg.parallelism.name,
        fsdp_degree=cfg.parallelism.fsdp_degree,
        activation_checkpointing=cfg.parallelism.activation_checkpointing,
        mixed_precision=cfg.parallelism.mixed_precision,
        capacity=cfg.masking.capacity,
        outer=dataclasses.asdict(cfg.outer),
        inner_width=cfg.model.inner_width,
    )
    return {"variant": variant, "coverage": cfg.masking.coverage, "protocol": str(cfg.trainer.protocol)}


def calibration_stream(cfg: RunConfig, strategy: Strategy, *, world: dist.World, batch_size: int, start_batch: int = 0):
    """Training batches for BatchNorm recalibration of the evaluated model, from a stream of
    their own (another seed), so the training data order is not disturbed; None when unused.
    `start_batch`: batches earlier evaluations of a resumed run took from it."""
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in strategy.model.modules())
    if cfg.masking.bn_recalibration_batches == 0 or not has_bn:
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


def resume_history(ckpt: Checkpoint | None, *, world: dist.World) -> list[dict]:
    """The run's resumes so far (carried in its checkpoints), this launch's last."""
    if ckpt is None:
        return []
    this = {"step": ckpt.step, "world_size": world.world_size, "checkpointed_with": ckpt.meta["world_size"]}
    return [*ckpt.meta.get("resumes", []), this]


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


def run(checked: Checked, world: dist.World) -> Summary:
    """Train the run `preflight` checked on this rank, from the start or from the newest intact
    checkpoint it found; rank 0 writes the run dir, and its summary.json however the run ends."""
    cfg, resume = checked.cfg, checked.resume
    device = dist.select_device(cfg.trainer.device, world, share=cfg.parallelism.backend == "gloo")
    backend = dist.default_backend(device) if cfg.parallelism.backend == "auto" else cfg.parallelism.backend
    dist.init_process_group(world, backend=backend, device=device, timeout_s=cfg.parallelism.timeout_s)
    summary, logger, reporter = _new_summary(cfg, world=world, device=device), None, world.is_main
    start_step = 0
    try:
        ckpt = pick_checkpoint(resume, world=world)
        start_step = ckpt.step if ckpt else 0
        run_dir = _choose_run_dir(cfg, world=world)
        summary.run_dir = str(run_dir)  # from here on a failure is reported in the run dir
        _open_run_dir(cfg, run_dir, world=world, resumed=resume is not None, ckpt=ckpt)
        logger = _open_logger(cfg, run_dir, world=world, ckpt=ckpt)
        built = _build(cfg, world=world, device=device, ckpt=ckpt, plan=checked.plan)
        _publish_mask(checked.plan, built.strategy, run_dir, world=world, logger=logger)
        summary.resumes = resume_history(ckpt, world=world)
        summary.n_params = built.strategy.full_params
        summary.throughput_unit = "tokens/s" if built.data.kind == "text" else "samples/s"
        summary.strategy.update(built.strategy.describe())
        dist.print0(
            world,
            f"run dir: {run_dir}  ({cfg.model.name}: {summary.n_params / 1e6:.2f}M params, "
            f"{world.world_size} x {built.micro} per step, {cfg.trainer.max_steps} steps, {device.type}/{backend})",
        )
        signals = StopSignals(device, launched=dist.under_launcher())
        try:
            _train(
                cfg,
                built,
                summary,
                world=world,
                device=device,
                logger=logger,
                run_dir=run_dir,
                ckpt=ckpt,
                signals=signals,
            )
        finally:
            signals.close()
        if world.is_main and cfg.trainer.export == "hf" and (run_dir / rundir.MODEL).is_file():
            export_model(cfg, run_dir, summary)
        summary.status = "stopped" if summary.stopped_at else "completed"
        return summary
    except KeyboardInterrupt as err:  # Ctrl-C before the loop, or twice: the steps done are kept
        stop = err if isinstance(err, Interrupted) else Interrupted(start_step, start_step or None)
        summary.status, summary.steps, summary.resumes_from = "interrupted", stop.step, stop.resumes_from
        raise stop from None
    except Exception as err:
        collective = dist.failed_collective(err)
        if collective is None:
            written = write_failure(err, run_dir=summary.run_dir)
            summary.status, summary.error = "failed", str(written or f"{type(err).__name__}: {err}")
            if written is None:
                raise
            raise written from err
        lost = peer_lost(collective, err, world=world, timeout_s=cfg.parallelism.timeout_s, run_dir=summary.run_dir)
        summary.status, summary.error, reporter = "failed", str(lost), lost.reporter
        raise lost from err
    finally:
        if logger is not None:
            if reporter:
                save_summary(Path(summary.run_dir), summary)
            logger.summary(summary.to_json())
            logger.close(exit_code=0 if summary.status == "completed" else 1)
        dist.destroy_process_group()


def _open_logger(cfg: RunConfig, run_dir: Path, *, world: dist.World, ckpt: Checkpoint | None) -> RunLogger:
    """The run's logger (logger.*): metrics.jsonl on rank 0, and W&B, which a resume continues
    (its run id is in the checkpoint), keyed by the tables' pivots."""
    return RunLogger(
        cfg.logger,
        run_dir=run_dir,
        metrics=run_dir / rundir.METRICS,
        run_name=run_name(cfg),
        active=world.is_main,
        config={**pivot_keys(cfg), **cfg.record},
        resume_id=ckpt.meta.get("wandb_id") if ckpt else None,
        job_type=pivot_keys(cfg)["variant"],
    )


def _publish_mask(plan, strategy: Strategy, run_dir: Path, *, world: dist.World, logger: RunLogger) -> None:
    """Rank 0 writes an SDP run's mask (of the epoch this launch starts in) to RUN_DIR/mask.json
    and uploads it with the W&B run: every unit's holders, its construction, seed and spectral gap."""
    if plan is None or not world.is_main:
        return
    path = run_dir / rundir.MASK
    rundir.write_json_atomic(path, plan.record(getattr(strategy, "epoch", 0)))
    logger.save(path)


def _new_summary(cfg: RunConfig, *, world: dist.World, device: torch.device) -> Summary:
    """The summary of a run that has just started: what runs."""
    return Summary(
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
        inner_width=cfg.model.inner_width,
    )


def _choose_run_dir(cfg: RunConfig, *, world: dist.World) -> Path:
    """Collective: the run dir, chosen by rank 0."""
    chosen = rundir.choose_run_dir(run_dir=cfg.run_dir, output_root=cfg.output_root, name=run_name(cfg))
    return Path(dist.broadcast_object(str(chosen) if world.is_main else None))


def _open_run_dir(cfg: RunConfig, run_dir: Path, *, world: dist.World, resumed: bool, ckpt: Checkpoint | None) -> None:
    """Rank 0 makes the run dir with config.yaml (a warning first when a resume finds it edited
    by hand) and the launch record; a resumed run's metrics after its checkpoint are dropped
    (written again). Each file is replaced whole or not at all (a full disk leaves what was there)."""
    if not world.is_main:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    edited = resumed and config_edits(run_dir / rundir.CONFIG, cfg.record, ckpt.meta.get("config") if ckpt else None)
    if edited:
        dist.warn0(world, edited)
    rundir.write_text_atomic(run_dir / rundir.CONFIG, record_yaml(cfg))
    rundir.record_launch(run_dir)  # a torchrun restart without run_dir finds this dir by it
    if resumed:
        rundir.truncate_metrics(run_dir, ckpt.step if ckpt else 0)


@dataclass
class Built:
    """A run's data, its model under its strategy, the optimizer and the lr schedule, restored
    from the checkpoint when resuming (`measured`: what the launch before had measured)."""

    data: DataBundle
    micro: int
    comm: CommCounter
    strategy: Strategy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    measured: dict | None
    outer: OuterLoop | None = None


def _build(cfg: RunConfig, *, world: dist.World, device: torch.device, ckpt: Checkpoint | None, plan) -> Built:
    """Collective: the data (rank 0 prepares it first), the model, optimizer and schedule."""
    start_step = ckpt.step if ckpt else 0
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
    every = cfg.masking.resample_every
    # A checkpoint is taken after the step's resample: it holds the next mask epoch's subnetwork.
    mask_epoch = start_step // every if every else 0
    strategy = build_strategy(cfg, world=world, device=device, comm=comm, mask_epoch=mask_epoch, plan=plan)
    # Initial weights were drawn alike on every rank; from here on each rank draws its own
    # dropout, drop-path and baseline masks.
    torch.manual_seed(cfg.seed + world.rank)
    optimizer = build_optimizer(strategy.trainable(), cfg.optim, device=device)
    scheduler = build_scheduler(optimizer, cfg.optim, max_steps=cfg.trainer.max_steps)
    loaded = None
    if ckpt:
        loaded = load_checkpoint(
            ckpt, strategy=strategy, optimizer=optimizer, scheduler=scheduler, world=world, device=device, seed=cfg.seed
        )
        before = ckpt.meta["world_size"]
        resized = f", re-cut from {before} processes for {world.world_size}" if before != world.world_size else ""
        dist.print0(world, f"resumed from {ckpt.path} (step {start_step}{resized})")
    outer = _outer_loop(cfg, strategy, comm, device, optimizer=optimizer, ckpt=ckpt, loaded=loaded, world=world)
    measured = loaded.measured if loaded else None
    return Built(data, micro, comm, strategy, optimizer, scheduler, measured, outer)


def _outer_loop(cfg: RunConfig, strategy: Strategy, comm: CommCounter, device, *, optimizer, ckpt, loaded, world):
    """Collective: the outer algorithm's loop over `strategy` (None without one): a new run's holders
    started alike, a resumed run's outer state restored from what `load_checkpoint` read of `ckpt`
    (on another world size, only at a sync boundary: the preflight checked the newest checkpoint,
    this is the one chosen, an older one when the newest was damaged)."""
    if not is_outer(cfg.outer):
        return None
    par = cfg.parallelism
    view = view_of(strategy, family=cfg.model.family, comm=comm, bucket_cap_mb=par.bucket_cap_mb)
    outer = algorithm_of(cfg.outer.name).build(
        cfg.outer,
        view,
        device=device,
        comm=comm,
        max_steps=cfg.trainer.max_steps,
        bucket_cap_mb=par.bucket_cap_mb,
    )
    if loaded is None:
        outer.start()
        return outer
    before = ckpt.meta["world_size"]
    check_resize(cfg.outer, run_dir=cfg.run_dir, step=ckpt.step, before=before, world_size=world.world_size)
    outer.restore(optimizer, loaded.outer_state or {}, loaded.outer_window)
    return outer


def _train(cfg, built: Built, summary: Summary, *, world, device, logger, run_dir: Path, ckpt, signals) -> None:
    """The training loop with its parts, each made from the typed config by its own constructor,
    then the end-of-run figures, into `summary`."""
    start_step, tcfg = ckpt.step if ckpt else 0, cfg.trainer
    seq_len = cfg.dataset.seq_len if built.data.kind == "text" else 1
    evals_done = start_step // tcfg.eval_every if tcfg.eval_every else 0
    calibration = calibration_stream(
        cfg,
        built.strategy,
        world=world,
        batch_size=built.micro,
        start_batch=evals_done * cfg.masking.bn_recalibration_batches,
    )
    target = CheckpointTarget.from_config(
        tcfg, run_dir=run_dir, config=cfg.record, extra_meta={"wandb_id": logger.wandb_id, "resumes": summary.resumes}
    )
    strategy, optimizer = built.strategy, built.optimizer
    state = SavedState(strategy, optimizer, built.scheduler, world=world, device=device, outer=built.outer)
    loop = Loop(
        strategy=strategy,
        data=built.data,
        optimizer=optimizer,
        scheduler=built.scheduler,
        meter=Meter.from_config(
            tcfg,
            strategy=strategy,
            optimizer=optimizer,
            device=device,
            comm=built.comm,
            start_step=start_step,
            seq_len=seq_len,
            measured=built.measured,
            outer=built.outer,
        ),
        nonfinite=NonFinitePolicy(
            tcfg, optimizer=optimizer, device=device, start_step=start_step, world=world, logger=logger, run_dir=run_dir
        ),
        checkpointer=Checkpointer.from_config(tcfg, target=target, state=state, start_step=start_step),
        evaluation=Evaluation.from_config(
            tcfg,
            data=built.data,
            device=device,
            world=world,
            run_dir=run_dir,
            calibration=calibration,
            calibration_batches=cfg.masking.bn_recalibration_batches,
        ),
        logger=logger,
        outer=built.outer,
    )
    summary.update(train(loop, tcfg, world=world, start_step=start_step, stop_requested=signals))
    if summary.stopped_at:
        summary.stopped_by = signals.reason or "trainer.stop_at_step"
    elif world.is_main:  # every evaluation of the run, its resumed launches' too, is in metrics.jsonl
        metric = gate_metric(built.data.kind)
        evals = rundir.evaluations(run_dir, metric)
        summary.convergence = plateau(evals, steps=tcfg.max_steps, metric=metric, threshold=tcfg.plateau_threshold)
    summary.update(
        loop.meter.figures(world_size=world.world_size, precision=cfg.parallelism.mixed_precision, seq_len=seq_len)
    )
    if built.outer is not None:
        summary.outer = built.outer.figures()


def main(overrides: list[str]) -> int:
    """Check, then train one run on this rank; the exit code: 0 done, 2 bad input (one line,
    before any process group), 3 a diagnosed failure (one line)."""
    world = dist.world_from_env()
    try:
        checked = preflight(overrides, world)
    except ConfigError as err:
        dist.print0(world, f"error: {err}", file=sys.stderr)
        if not world.is_main:
            # Every rank finds the same error, rank 0 reports it: torchrun stops the job when
            # the first rank exits, so the others leave after rank 0 has had time to print.
            time.sleep(2)
        return 2
    try:
        summary = run(checked, world)
    except ConfigError as err:  # found once the data is there (too small for a batch): bad input all the same
        dist.print0(world, f"error: {err}", file=sys.stderr)
        return 2
    except RunFailed as err:  # diagnosed (and in summary.json once it exists): one line, no traceback
        if err.reporter if isinstance(err, PeerLost) else world.is_main:
            print(redact_text(f"error: {err}"), file=sys.stderr, flush=True)
        return 3
    except KeyboardInterrupt as err:  # Ctrl-C twice, or before the loop: one line, no traceback
        step, resumes = (err.step, err.resumes_from) if isinstance(err, Interrupted) else (0, None)
        if world.is_main:
            print(f"interrupted after step {step}; {resume_hint(resumes)}", file=sys.stderr, flush=True)
        return 130
    if world.is_main:
        print_result(summary)
    return 130 if summary.stopped_by == "SIGINT" else 0
