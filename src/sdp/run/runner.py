"""One run on this rank: the checks before any process group, then process group, run dir,
data, model under its strategy, optimizer, resume, the training loop, and summary.json however
the run ends. `sdp.train` (the entrypoint) and a sweep's Slurm tasks call `main`."""

from __future__ import annotations

import copy
import functools
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sdp import dist, rundir
from sdp.data import DataBundle, build_data, prepare_data
from sdp.errors import ConfigError, Interrupted, PeerLost, RunFailed, WriteFailed
from sdp.metrics.comm import CommCounter
from sdp.metrics.logger import RunLogger
from sdp.optim import build_optimizer, build_scheduler
from sdp.parallel import Strategy
from sdp.redact import redact_text
from sdp.run.build import build_strategy
from sdp.run.checkpoint import (
    Checkpoint,
    Checkpointer,
    CheckpointTarget,
    Resume,
    SavedState,
    check_resume,
    choose_checkpoint,
    complete_checkpoints,
    load_checkpoint,
    write_checkpoint,
)
from sdp.run.config import RunConfig, load_config, record_yaml, typed_config, validate
from sdp.run.measure import Meter
from sdp.run.nonfinite import NonFinitePolicy
from sdp.run.trainer import Evaluation, micro_batch_size, train
from sdp.rundir import Summary, variant_label, write_error
from sdp.rundir.hf import EXPORT_DIR, export_run_dir, exported_files


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
    )
    return {"variant": variant, "coverage": cfg.masking.coverage, "protocol": str(cfg.trainer.protocol)}


def check_run_dir(cfg: RunConfig) -> Resume | None:
    """Before any process group: the checkpoints to resume from when run_dir holds some (and
    the config matches), None for a new run; a completed run, or one that cannot be resumed,
    is refused with one error and nothing written so far is touched.

    A torchrun restart (--max-restarts) of a launch without run_dir finds the run dir its
    first attempt created by the job's rendezvous id (launch.json)."""
    if cfg.run_dir:
        rundir.check_writable("run_dir", Path(cfg.run_dir))
    else:
        rundir.check_writable("output_root", Path(cfg.output_root))
    if not cfg.run_dir:
        cfg.run_dir = rundir.elastic_run_dir(cfg.output_root)
        if not cfg.run_dir:
            return None
    run_dir = Path(cfg.run_dir)
    return check_resume(run_dir, cfg.record, restarted=rundir.restarted_job(run_dir))


class StopSignals:
    """Signals that ask the run to checkpoint and stop after the current log step: SIGTERM and
    SIGUSR1 (a scheduler's preemption notice; torchrun passes SIGTERM on to its workers) and
    SIGINT (Ctrl-C). A second Ctrl-C stops at once (KeyboardInterrupt); under a launcher, whose
    agent passes the first one on as well, only one that comes `repeat_s` after the first.
    Installed for the training loop, then `close()` gives the handlers back."""

    def __init__(self, device: torch.device, *, launched: bool, repeat_s: float = 2.0):
        self.device, self.launched, self.repeat_s = device, launched, repeat_s
        self.reason: str | None = None
        self._first_sigint: float | None = None
        self._previous = {
            sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
        }

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._first_sigint is not None and not (self.launched and now - self._first_sigint < self.repeat_s):
                raise KeyboardInterrupt
            self._first_sigint = self._first_sigint or now
        self.reason = self.reason or signal.Signals(signum).name

    def __call__(self) -> bool:
        """Whether any rank was signalled (collective: every rank agrees)."""
        t = torch.tensor([float(self.reason is not None)], device=self.device)
        return dist.all_reduce_(t, op="max").item() > 0

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


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


def resume_history(ckpt: Checkpoint | None, *, world: dist.World) -> list[dict]:
    """The run's resumes so far (carried in its checkpoints), this launch's last."""
    if ckpt is None:
        return []
    this = {"step": ckpt.step, "world_size": world.world_size, "checkpointed_with": ckpt.meta["world_size"]}
    return [*ckpt.meta.get("resumes", []), this]


# A refused world size lists the ones that would resume, up to twice the larger of the two.
def resize_refusal(overrides: list[str], err: ConfigError, *, world_size: int) -> ConfigError | None:
    """When a launch resumes a run dir on a world size its config does not allow (C x K not a
    whole number, an fsdp_degree that does not divide it, a batch that does not split), the
    refusal names run_dir and the world sizes that would resume; None otherwise."""
    if not any(o.lstrip("+~").partition("=")[0] == "run_dir" for o in overrides):
        return None  # no run dir to resume: nothing to compose again
    try:
        cfg = typed_config(overrides)
    except ConfigError:
        return None
    found = complete_checkpoints(Path(cfg.run_dir)) if cfg.run_dir and Path(cfg.run_dir).is_dir() else []
    before = found[-1].meta.get("world_size") if found else None
    if not isinstance(before, int) or before == world_size:
        return None

    def fits(n: int) -> bool:
        try:
            validate(copy.deepcopy(cfg), world_size=n, offline=dist.hub_offline(), check_data=False)
        except ConfigError:
            return False
        return True

    if not fits(before):
        return None  # the config itself changed: its own error says what is wrong
    limit = 2 * max(before, world_size)
    allowed = ", ".join(str(n) for n in range(1, limit + 1) if fits(n))
    return ConfigError(
        "run_dir",
        cfg.run_dir,
        f"was checkpointed with {before} processes and cannot resume on {world_size} ({err}); "
        f"it resumes on {allowed} processes (of 1 to {limit})",
    )


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


def run(cfg: RunConfig, world: dist.World, resume: Resume | None = None) -> Summary:
    """Train one configured run on this rank, from the start or from the newest intact
    checkpoint of `resume`; rank 0 writes the run dir, and its summary.json however the run ends."""
    device = dist.select_device(cfg.trainer.device, world, share=cfg.parallelism.backend == "gloo")
    backend = dist.default_backend(device) if cfg.parallelism.backend == "auto" else cfg.parallelism.backend
    dist.init_process_group(world, backend=backend, device=device, timeout_s=cfg.parallelism.timeout_s)
    summary, logger, reporter = _new_summary(cfg, world=world, device=device), None, world.is_main
    start_step = 0
    try:
        ckpt = pick_checkpoint(resume, world=world)
        start_step = ckpt.step if ckpt else 0
        run_dir = _open_run_dir(cfg, world=world, resumed=resume is not None, start_step=start_step)
        summary.run_dir = str(run_dir)
        logger = RunLogger(
            cfg.logger,
            run_dir=run_dir,
            metrics=run_dir / rundir.METRICS,
            run_name=run_name(cfg),
            active=world.is_main,
            config={**pivot_keys(cfg), **cfg.record},
            resume_id=ckpt.meta.get("wandb_id") if ckpt else None,
            job_type=pivot_keys(cfg)["variant"],
        )
        built = _build(cfg, world=world, device=device, ckpt=ckpt)
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
            _export(cfg, run_dir, summary)
        summary.status = "stopped" if summary.stopped_at else "completed"
        return summary
    except KeyboardInterrupt as err:  # Ctrl-C before the loop, or twice: the steps done are kept
        stop = err if isinstance(err, Interrupted) else Interrupted(start_step, start_step or None)
        summary.status, summary.steps, summary.resumes_from = "interrupted", stop.step, stop.resumes_from
        raise stop from None
    except Exception as err:
        collective = dist.failed_collective(err)
        if collective is None:
            written = _write_failure(err, run_dir=summary.run_dir)
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
                _write_summary(Path(summary.run_dir), summary)
            logger.summary(summary.to_json())
            logger.close(exit_code=0 if summary.status == "completed" else 1)
        dist.destroy_process_group()


def _write_failure(err: BaseException, *, run_dir: str | None) -> WriteFailed | None:
    """A run dir file that could not be written (model.pt, or any write on a full disk) as one
    line with what the same command then does; None for any other error."""
    if not (isinstance(err, WriteFailed) or rundir.disk_full(err)) or run_dir is None:
        return None
    line = str(err) if isinstance(err, WriteFailed) else write_error(err, Path(err.filename or run_dir))
    found = complete_checkpoints(Path(run_dir))
    then = (
        f"free space, then the same command resumes from step {found[-1].step}"
        if found
        else "no checkpoint was kept: free space, then start it again in a new run_dir"
    )
    return WriteFailed(f"{line}; {then}")


def _write_summary(run_dir: Path, summary: Summary) -> None:
    """summary.json, or one line saying why it could not be written (the run's outcome stands)."""
    try:
        rundir.write_summary(run_dir, summary)
    except OSError as err:
        print(f"error: summary.json not written: {write_error(err, run_dir / rundir.SUMMARY)}", file=sys.stderr)


def _export(cfg: RunConfig, run_dir: Path, summary: Summary) -> None:
    """Rank 0: RUN_DIR/hf/ from model.pt. A failed export (a full disk) does not fail a run
    whose training finished and whose model.pt is whole: hf/ is removed rather than left
    half-written, one warning line names the path, and `python -m sdp.export RUN_DIR` writes it
    later; `summary.export_error` keeps the reason."""
    try:
        export_run_dir(run_dir, cfg.model, cfg.dataset)
    except Exception as err:  # noqa: BLE001 - reported in one line; the run itself is complete
        summary.export_error = write_error(err, run_dir / EXPORT_DIR)
        print(
            f"warning: the export was not written ({summary.export_error}); the run is complete and its "
            f"model.pt whole: python -m sdp.export {run_dir} writes it",
            file=sys.stderr,
            flush=True,
        )
        return
    summary.export = exported_files(run_dir)


# How long the ranks whose collective failed wait for each other's reports (a hung rank sends none).
ROLL_CALL_S = 5.0


def peer_lost(collective: str, err: BaseException, *, world: dist.World, timeout_s: float, run_dir) -> PeerLost:
    """The one-line diagnosis of a collective that timed out or lost a peer: which collective,
    which ranks did not report the failure too (the hung ones, as far as the job's store
    knows), and the checkpoint a restart resumes from. The lowest rank that reports it is the
    one that prints it and writes summary.json."""
    reported = dist.roll_call(world, wait_s=ROLL_CALL_S)
    silent = [r for r in range(world.world_size) if reported is not None and r not in reported]
    if silent:
        who = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped responding"
    else:
        who = "a rank stopped responding or left the job"
    timed_out = "time" in str(err).lower()
    cause = f"got no reply within parallelism.timeout_s={timeout_s:g}" if timed_out else "lost its connection to a peer"
    found = complete_checkpoints(Path(run_dir)) if run_dir else []
    kept = (
        f"the last checkpoint, step {found[-1].step}, is kept: the same command resumes from it, "
        "and so does torchrun --max-restarts"
        if found
        else "no checkpoint was written yet"
    )
    return PeerLost(
        f"{who}: rank {world.rank} {cause} in {collective}; {kept}",
        reporter=reported is None or reported[0] == world.rank,
    )


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
    )


def _open_run_dir(cfg: RunConfig, *, world: dist.World, resumed: bool, start_step: int) -> Path:
    """Collective: the run dir, chosen by rank 0 and made there with config.yaml and the launch
    record; a resumed run's metrics after its checkpoint are dropped (written again)."""
    chosen = rundir.choose_run_dir(run_dir=cfg.run_dir, output_root=cfg.output_root, name=run_name(cfg))
    run_dir = Path(dist.broadcast_object(str(chosen) if world.is_main else None))
    if world.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / rundir.CONFIG).write_text(record_yaml(cfg))
        rundir.record_launch(run_dir)  # a torchrun restart without run_dir finds this dir by it
        if resumed:
            rundir.truncate_metrics(run_dir, start_step)
    return run_dir


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


def _build(cfg: RunConfig, *, world: dist.World, device: torch.device, ckpt: Checkpoint | None) -> Built:
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
    strategy = build_strategy(cfg, world=world, device=device, comm=comm, mask_epoch=mask_epoch)
    # Initial weights were drawn alike on every rank; from here on each rank draws its own
    # dropout, drop-path and baseline masks.
    torch.manual_seed(cfg.seed + world.rank)
    optimizer = build_optimizer(strategy.trainable(), cfg.optim, device=device)
    scheduler = build_scheduler(optimizer, cfg.optim, max_steps=cfg.trainer.max_steps)
    measured = None
    if ckpt:
        measured = load_checkpoint(
            ckpt, strategy=strategy, optimizer=optimizer, scheduler=scheduler, world=world, device=device, seed=cfg.seed
        )
        before = ckpt.meta["world_size"]
        resized = f", re-cut from {before} processes for {world.world_size}" if before != world.world_size else ""
        dist.print0(world, f"resumed from {ckpt.path} (step {start_step}{resized})")
    return Built(data, micro, comm, strategy, optimizer, scheduler, measured)


def _train(cfg, built: Built, summary: Summary, *, world, device, logger, run_dir: Path, ckpt, signals) -> None:
    """The training loop with its components (meter, NaN/Inf policy, checkpointer, evaluation),
    then the end-of-run figures, into `summary`."""
    start_step, tcfg = ckpt.step if ckpt else 0, cfg.trainer
    strategy, optimizer, scheduler = built.strategy, built.optimizer, built.scheduler
    evals_done = start_step // tcfg.eval_every if tcfg.eval_every else 0
    calibration = calibration_stream(
        cfg,
        strategy,
        world=world,
        batch_size=built.micro,
        start_batch=evals_done * cfg.masking.bn_recalibration_batches,
    )
    save = functools.partial(
        write_checkpoint,
        CheckpointTarget(
            run_dir,
            config=cfg.record,
            keep=tcfg.keep_checkpoints,
            extra_meta={"wandb_id": logger.wandb_id, "resumes": summary.resumes},
        ),
        SavedState(strategy, optimizer, scheduler, world=world, device=device),
    )
    seq_len = cfg.dataset.seq_len if built.data.kind == "text" else 1
    meter = Meter(
        strategy,
        optimizer,
        device=device,
        comm=built.comm,
        profile_step=tcfg.profile_step,
        max_steps=tcfg.max_steps,
        start_step=start_step,
        units_per_step=tcfg.global_batch_size * seq_len,
        measured=built.measured,
    )
    loop = train(
        strategy=strategy,
        data=built.data,
        optimizer=optimizer,
        scheduler=scheduler,
        cfg=tcfg,
        world=world,
        logger=logger,
        meter=meter,
        nonfinite=NonFinitePolicy(
            tcfg.on_nonfinite,
            max_skips=tcfg.max_nonfinite_skips,
            optimizer=optimizer,
            device=device,
            start_step=start_step,
            world=world,
            logger=logger,
            run_dir=run_dir,
        ),
        checkpointer=Checkpointer(
            save,
            every=tcfg.checkpoint_every,
            max_steps=tcfg.max_steps,
            start_step=start_step,
        ),
        evaluation=Evaluation(
            built.data,
            device=device,
            world=world,
            calibration=calibration,
            calibration_batches=cfg.masking.bn_recalibration_batches,
            model_path=run_dir / rundir.MODEL if tcfg.save_model else None,
        ),
        start_step=start_step,
        stop_requested=signals,
    )
    summary.update(loop)
    if summary.stopped_at:
        summary.stopped_by = signals.reason or "trainer.stop_at_step"
    summary.update(
        meter.figures(world_size=world.world_size, precision=cfg.parallelism.mixed_precision, seq_len=seq_len)
    )


def preflight(overrides: list[str], world: dist.World) -> tuple[RunConfig, Resume | None]:
    """Every check before any process group: the config for this world size, then the run dir
    (what it resumes from); one ConfigError naming a key when the input is bad. Writes nothing."""
    try:
        cfg = load_config(overrides, world_size=world.world_size, offline=dist.hub_offline())
        return cfg, check_run_dir(cfg)
    except ConfigError as err:
        raise (resize_refusal(overrides, err, world_size=world.world_size) or err) from None


def main(overrides: list[str]) -> int:
    """Check, then train one run on this rank; the exit code: 0 done, 2 bad input (one line,
    before any process group), 3 a diagnosed failure (one line)."""
    world = dist.world_from_env()
    try:
        cfg, resume = preflight(overrides, world)
    except ConfigError as err:
        dist.print0(world, f"error: {err}", file=sys.stderr)
        if not world.is_main:
            # Every rank finds the same error, rank 0 reports it: torchrun stops the job when
            # the first rank exits, so the others leave after rank 0 has had time to print.
            time.sleep(2)
        return 2
    try:
        summary = run(cfg, world, resume=resume)
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


def resume_hint(step: int | None) -> str:
    return f"the same command resumes from step {step}" if step else "the same command starts it again"


def print_result(summary: Summary) -> None:
    """A short human-readable result line block for the terminal."""
    mem = summary.memory
    values = {"train_loss": summary.train_loss, "eval_loss": summary.eval_loss, "eval_acc": summary.eval_acc}
    quality = " ".join(f"{k}={v:.4f}" for k, v in values.items() if v is not None)
    speed = summary.tokens_or_samples_per_s
    speed = "" if speed is None else f"{speed:.1f} {summary.throughput_unit}, "
    peak = "" if mem["peak_bytes"] is None else f", live peak {mem['peak_bytes'] / 2**20:.1f} MiB/rank"
    verb = "done"
    if summary.stopped_at:
        by = "Ctrl-C" if summary.stopped_by == "SIGINT" else summary.stopped_by
        verb = f"stopped ({by}); {resume_hint(summary.resumes_from)}"
    print(
        f"{verb}: {summary.steps} steps, {quality}, {speed}"
        f"params+grads+optim {summary.static_bytes / 2**20:.1f} MiB/rank{peak}, "
        f"comm {summary.comm_bytes_per_step / 2**20:.2f} MiB/step -> {summary.run_dir}",
        flush=True,
    )
