"""Every check of a run before any process group: its config for this world size, then its run
dir (what it resumes from). Bad input is one ConfigError naming a key; nothing is written.
`sdp.train` calls `preflight` before it launches any worker, and each worker again."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from sdp import dist, rundir
from sdp.errors import ConfigError
from sdp.outer import check_resize
from sdp.paths import DamagedFile, describe
from sdp.run.checkpoint import complete_checkpoints
from sdp.run.config import RunConfig, typed_config, validate
from sdp.run.resume import Resume, check_resume
from sdp.subnet.plan import SubnetPlan


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
    if cfg.masking.capacity is not None and err.key == "masking.capacity":  # one capacity per worker
        return ConfigError(
            "run_dir",
            cfg.run_dir,
            f"was checkpointed with {before} processes and cannot resume on {world_size} ({err}); give "
            f"masking.capacity for the new workers, with the same mean {cfg.masking.coverage:g} (the run's coverage)",
        )
    limit = 2 * max(before, world_size)
    allowed = ", ".join(str(n) for n in range(1, limit + 1) if fits(n))
    return ConfigError(
        "run_dir",
        cfg.run_dir,
        f"was checkpointed with {before} processes and cannot resume on {world_size} ({err}); "
        f"it resumes on {allowed} processes (of 1 to {limit})",
    )


def check_machine(cfg: RunConfig) -> None:
    """What this machine must have for the run to start here (the estimator and a sweep's dry
    run may describe a GPU cluster from a laptop; a launch may not)."""
    backend = cfg.parallelism.backend
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("parallelism.backend", backend, "needs CUDA, which this machine lacks; here: auto or gloo")
    if backend == "nccl" and cfg.trainer.device == "cpu":
        raise ConfigError("parallelism.backend", backend, "cannot reduce CPU tensors (trainer.device=cpu); use gloo")


@dataclass
class Checked:
    """What the checks found, handed on to the run: its config, what it resumes from (None for a
    new run), and SDP's plan (None without SDP), built once here for the strategy to take over."""

    cfg: RunConfig
    resume: Resume | None
    plan: SubnetPlan | None


def preflight(overrides: list[str], world: dist.World) -> Checked:
    """Every check before any process group: the config for this world size, then the run dir
    (what it resumes from); one ConfigError naming a key when the input is bad. Writes nothing."""
    try:
        cfg = typed_config(overrides)
        plan = validate(cfg, world_size=world.world_size, offline=dist.hub_offline())
        check_machine(cfg)
        resume = check_run_dir(cfg)
    except ConfigError as err:
        raise (resize_refusal(overrides, err, world_size=world.world_size) or err) from None
    if resume is not None and resume.candidates:  # the newest one; an older one is checked when loaded
        newest = resume.candidates[0]
        check_resize(
            cfg.outer,
            run_dir=cfg.run_dir,
            step=newest.step,
            before=newest.meta["world_size"],
            world_size=world.world_size,
        )
        check_mask(plan, Path(cfg.run_dir), before=newest.meta["world_size"], world_size=world.world_size)
    return Checked(cfg, resume, plan)


def check_mask(plan: SubnetPlan | None, run_dir: Path, *, before: int, world_size: int) -> None:
    """A resume on the world size it stopped at, without resampling, trains the mask the run
    trained: the one this launch builds must equal RUN_DIR/mask.json (a change in how masks are
    built, between versions of this code, would otherwise move units to other holders unseen)."""
    path = run_dir / rundir.MASK
    if plan is None or plan.cfg.resample_every or before != world_size or not path.is_file():
        return
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DamagedFile(path, f"is not a mask record: {describe(err)}") from None
    built = json.loads(json.dumps(plan.record(0)))
    if recorded != built:
        differ = [g["name"] for g, r in zip(built["groups"], recorded.get("groups", []), strict=False) if g != r]
        where = f"the holders of {differ[0]}'s units" if differ else "its construction"
        raise ConfigError(
            "run_dir",
            str(run_dir),
            f"trained another mask than this launch builds ({where} differ from {rundir.MASK}): resume it "
            "with the version of this code that started it, or start a new run_dir",
        )
