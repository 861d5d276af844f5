"""Writing a run's checkpoints: per-rank files in the run dir, published whole or not at all.
Reading them back (the checks before a resume, the choice of an intact one, loading it on any
world size) is `sdp.run.resume`.

Layout: `RUN_DIR/checkpoints/step_00000120/` holds one `rank00003.pt` per rank
that owns distinct state, and `meta.json`, with a manifest of those files (size
and SHA-256). A checkpoint is written into `step_N.partial/`: every rank writes
and fsyncs its file, rank 0 writes `meta.json` once every rank has succeeded and
renames the directory to `step_N/`, so a complete-looking checkpoint is always
a complete one. A failed write (a full disk) removes the partial directory and
keeps the checkpoints before it. Older complete checkpoints are removed once a
newer one is complete (`trainer.keep_checkpoints`).

A checkpoint is portable: it holds the run's state in the plain model's
coordinates (`sdp.parallel.PortableState`: every model tensor whole, every
parameter's optimizer state whole, gathered from the holders as a mask resample
gathers it), so it does not depend on the world size or on how the strategy
cut the model. Every rank writes every world_size-th tensor of it (by sorted
name), with its own RNG streams and measurements; rank 0's file also holds the
step, the lr schedule and the optimizer's scalar state and settings. A resume
reads all the files and the strategy cuts its pieces from them, as after a
mask resample: on the same world size it continues bit for bit (each rank gets
its RNG streams back); on another one (a node lost, a job grown) every tensor
and every unit's optimizer state is carried exactly to its new holders, and the
RNG streams are drawn anew from (seed, rank, step). The data position, the lr
schedule and the mask epoch follow from the step. The config must be the same
(checked before any process group starts).

"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sdp import dist
from sdp.dist import local
from sdp.outer.loop import OuterLoop
from sdp.parallel import PortableState, Strategy
from sdp.run.trainer_config import TrainerConfig
from sdp.rundir import CHECKPOINTS, write_error, write_json_atomic

# meta.json's "format": 2 is the portable checkpoint; 1 (no "format") held each rank's pieces.
FORMAT = 2


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    meta: dict


def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step_{step:08d}"


STEP_DIR = re.compile(r"step_(\d{8})")


def complete_checkpoints(run_dir: Path, problems: list[str] | None = None) -> list[Checkpoint]:
    """The run dir's complete checkpoints (a `step_N/` dir with a readable meta.json), oldest
    first. An unreadable meta.json is skipped and described in `problems` (when given)."""
    root = run_dir / CHECKPOINTS
    out = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        meta = d / "meta.json"
        if not (STEP_DIR.fullmatch(d.name) and d.is_dir() and meta.is_file()):
            continue  # a partial checkpoint (step_N.partial) or something else
        try:
            info = json.loads(meta.read_text())
            out.append(Checkpoint(int(info["step"]), d, info))
        except (OSError, ValueError, KeyError, TypeError) as err:
            if problems is not None:
                problems.append(f"{d.name}/meta.json is unreadable ({type(err).__name__}: {err})")
    return sorted(out, key=lambda c: c.step)


def file_digest(path: Path) -> str:
    """SHA-256 of a file, read in 16 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(1 << 24):
            h.update(piece)
    return h.hexdigest()


def _rng_state(device: torch.device) -> dict:
    """Every RNG stream of this process, as tensors and plain values (loadable with weights_only)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, words, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "python": [version, list(words), gauss_next],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _finite(t: torch.Tensor) -> bool:
    t = local(t)
    return not t.is_floating_point() or bool(torch.isfinite(t).all())


def rank_file(path: Path, rank: int) -> Path:
    return path / f"rank{rank:05d}.pt"


def _write(obj, path: Path) -> dict:
    """torch.save `obj` to `path`, flushed to the disk; returns its manifest entry."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": file_digest(path)}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class CheckpointTarget:
    """Where a run's checkpoints go and what each one's meta.json records besides its manifest:
    the run's config, `extra_meta` (the W&B run id, the resumes so far); the newest `keep`
    complete ones are kept."""

    run_dir: Path
    config: dict
    keep: int
    extra_meta: dict | None = None

    @classmethod
    def from_config(cls, cfg: TrainerConfig, *, run_dir: Path, config: dict, extra_meta: dict) -> CheckpointTarget:
        return cls(run_dir, config=config, keep=cfg.keep_checkpoints, extra_meta=extra_meta)


@dataclass(frozen=True)
class SavedState:
    """What a checkpoint is read from, and where this rank runs: the strategy gathers the portable
    state of the model and `optimizer`; `scheduler` is the lr schedule; `outer`, an outer loop
    (outer=diloco), whose synced weights are the checkpoint's model and whose momentum and
    per-rank window (local weights, buffers, inner optimizer state) go with it."""

    strategy: Strategy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    world: dist.World
    device: torch.device
    outer: OuterLoop | None = None


@dataclass(frozen=True)
class _Prepared:
    """Phase 1's outcome: where the checkpoint goes, rank 0's error making the partial directory
    (the same on every rank: broadcast) and this rank's copy of the portable state."""

    final: Path
    tmp: Path
    error: str | None
    portable: PortableState
    outer: tuple[dict, dict] | None = None  # OuterLoop.checkpoint's (momentum, this rank's window)


def write_checkpoint(
    target: CheckpointTarget, state: SavedState, *, step: int, measured: dict | None = None
) -> Path | None:
    """Write this rank's part of the checkpoint of `step` (collective: every rank calls it);
    `measured` is this rank's memory/FLOP measurements so far, which a resumed run keeps.

    Returns the checkpoint's directory, or None when a rank could not write its part (a full
    disk, say): then the partial directory is removed, the checkpoints before it are kept,
    rank 0 prints one warning naming the rank and the error, and training goes on.

    In phases, each run by every rank. Every collective is issued unconditionally, in the same
    order on every rank (with NCCL, one rank issuing another sequence hangs the job): none sits
    in a branch that depends on this rank's own IO, whose errors are kept as values instead.
      1. prepare (`_prepare`): the strategy settles; rank 0 makes `step_N.partial/`, and its
         error, if any, is broadcast; every rank gathers the portable state (collectives).
      2. write (`_write_part`): this rank's file, unless phase 1 failed; file IO only, no
         collective; an error is caught and returned, never raised.
      3. agree (`_agree`): one all-gather of every rank's manifest entries and error.
      4. commit or roll back: when no rank failed, rank 0 writes meta.json and renames the
         directory (`_commit`, file IO only); rank 0's verdict, its commit's error included, is
         broadcast; rank 0 removes the partial directory and warns (`_roll_back`) or removes
         the checkpoints past `keep` (`_prune`); a barrier.
    """
    world = state.world
    prepared = _prepare(target, state, step)  # 1. collectives, the same on every rank
    entries, error = _write_part(prepared, state, step=step, measured=measured)  # 2. IO only
    entries, errors = _agree(entries, error)  # 3. the one collective on the writes
    if world.is_main and not errors:  # 4. rank 0 commits (IO only); its verdict goes to every rank
        errors = _commit(prepared.tmp, prepared.final, _meta(target, world, step=step, files=entries))
    errors = dist.broadcast_object(errors)
    if world.is_main and errors:
        _roll_back(prepared.tmp, target.run_dir, step=step, errors=errors, world=world)
    elif world.is_main:
        _prune(target)
    dist.barrier()
    return None if errors else prepared.final


def _prepare(target: CheckpointTarget, state: SavedState, step: int) -> _Prepared:
    """Phase 1, collective: rank 0 makes the partial directory (its error broadcast, so that every
    rank knows whether to write), then every rank gathers the portable state."""
    state.strategy.settle()  # what is saved must be current (an overlapped weight refresh is finished)
    final = _step_dir(target.run_dir, step)
    tmp = final.with_name(final.name + ".partial")
    error = None
    if state.world.is_main:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as err:
            error = f"rank 0: {write_error(err, tmp)}"
    error = dist.broadcast_object(error)
    # Collective: every rank, whatever happened above. The model is the synced one (an outer
    # loop's theta_prev); each rank's own window is saved beside it.
    with state.outer.synced() if state.outer is not None else contextlib.nullcontext():
        portable = state.strategy.portable_state(state.optimizer)
    outer = state.outer.checkpoint(state.optimizer) if state.outer is not None else None
    return _Prepared(final, tmp, error, portable, outer)


def _write_part(prepared: _Prepared, state: SavedState, *, step: int, measured) -> tuple[dict, str | None]:
    """Phase 2, no collective: this rank's file and its manifest entry, or the error that kept it
    from being written (caught: the ranks agree on it in phase 3)."""
    if prepared.error is not None:
        return {}, prepared.error
    world, path = state.world, rank_file(prepared.tmp, state.world.rank)
    try:
        saved = _rank_state(
            step, prepared.portable, state.scheduler, world=world, device=state.device, measured=measured
        )
        if prepared.outer is not None:
            state, window = prepared.outer
            saved["outer"] = {"state": {n: state[n] for n in _share(state, world)}, "window": window}
        return {path.name: _write(saved, path)}, None
    except Exception as err:  # noqa: BLE001 - reported to every rank in phase 3, then training goes on
        return {}, f"rank {world.rank}: {write_error(err, path)}"


def _share(names, world: dist.World) -> list[str]:
    """The names whose tensors this rank writes: every world_size-th, in sorted order."""
    return sorted(names)[world.rank :: world.world_size]


def _rank_state(step: int, state: PortableState, scheduler, *, world: dist.World, device, measured) -> dict:
    """What this rank writes: its share of the portable state, its RNG streams and measurements,
    and on rank 0 what is said once (the step, the lr schedule, the optimizer's scalar state and
    settings). A diverged (non-finite) tensor is refused: a checkpoint is always a good one."""
    model = {n: state.model[n] for n in _share(state.model, world)}
    diverged = [n for n, t in model.items() if not _finite(t)]
    if diverged:
        raise ValueError(f"{diverged[0]} is not finite: a diverged state is not saved")
    params = _share({n for per in state.optim.values() for n in per}, world)
    out = {
        "step": step,
        "model": model,
        "optim": {key: {n: per[n] for n in params if n in per} for key, per in state.optim.items()},
        "rng": _rng_state(device),
        "measured": measured,
    }
    if world.is_main:
        out.update(scheduler=scheduler.state_dict(), scalars=state.scalars, groups=state.groups)
    return out


def _agree(entries: dict, error: str | None) -> tuple[dict, list[str]]:
    """Phase 3, the one collective that agrees on the writes: every rank's manifest entries (all
    of them) and errors (the ones that happened)."""
    parts = dist.gather_objects((entries, error))
    return {name: entry for part, _ in parts for name, entry in part.items()}, [e for _, e in parts if e]


def _meta(target: CheckpointTarget, world: dist.World, *, step: int, files: dict) -> dict:
    """What rank 0 writes into meta.json: the step, the format, the world size, the config, the
    manifest of every rank's file and the run's `extra_meta`."""
    return {
        "step": step,
        "format": FORMAT,
        "world_size": world.world_size,
        "config": target.config,
        "files": files,
        **(target.extra_meta or {}),
    }


def _commit(tmp: Path, final: Path, meta: dict) -> list[str]:
    """Rank 0, once every rank's file is written: meta.json, then the rename that makes the
    checkpoint complete; returns what went wrong ([] when it is complete)."""
    try:
        write_json_atomic(tmp / "meta.json", meta)
        _fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        _fsync_dir(final.parent)
    except OSError as err:
        return [f"rank 0: {write_error(err, tmp / 'meta.json')}"]
    return []


def _roll_back(tmp: Path, run_dir: Path, *, step: int, errors: list[str], world: dist.World) -> None:
    """Rank 0, when the checkpoint was not written (a rank's part, or rank 0's commit, failed):
    the partial directory is removed and one warning names what failed and what is kept."""
    shutil.rmtree(tmp, ignore_errors=True)
    kept = [c.path.name for c in complete_checkpoints(run_dir)]
    dist.warn0(
        world,
        f"checkpoint of step {step} not written ({'; '.join(errors)}); "
        f"kept {', '.join(kept) or 'no earlier checkpoint'} in {run_dir / CHECKPOINTS}; "
        "training goes on and tries again at the next checkpoint",
    )


def _prune(target: CheckpointTarget) -> None:
    """Rank 0, once a checkpoint is complete: the complete ones before the newest `keep` are removed."""
    for old in complete_checkpoints(target.run_dir)[: -target.keep]:
        shutil.rmtree(old.path, ignore_errors=True)


class Checkpointer:
    """The loop's checkpoints: due every `every` steps before the last (0: never) and before an
    early stop; it writes them through `save(step=, measured=)` (collective, None when a rank
    could not write its part) and counts what they cost: checkpoints written, failures, wall
    time (outside the step times). `last` is the step of the newest one this run can fall
    back to (a resumed run's start)."""

    def __init__(self, save: Callable[[int, dict], Path | None] | None, *, every: int, max_steps: int, start_step: int):
        self._save, self.every, self.max_steps = save, every, max_steps
        self.last = start_step or None
        self.written_ok = True  # whether the last attempt was written
        self.written, self.failures, self.seconds = 0, 0, 0.0

    @classmethod
    def from_config(
        cls, cfg: TrainerConfig, *, target: CheckpointTarget, state: SavedState, start_step: int
    ) -> Checkpointer:
        """trainer.checkpoint_every of trainer.max_steps, each checkpoint of `state` written to
        `target` (which keeps the newest trainer.keep_checkpoints: `CheckpointTarget.from_config`)."""
        save = functools.partial(write_checkpoint, target, state)
        return cls(save, every=cfg.checkpoint_every, max_steps=cfg.max_steps, start_step=start_step)

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0 and step < self.max_steps

    def save(self, step: int, measured: dict) -> None:
        if self._save is None:
            return
        start = time.perf_counter()
        self.written_ok = self._save(step=step, measured=measured) is not None
        self.seconds += time.perf_counter() - start
        self.written += self.written_ok
        self.failures += not self.written_ok
        self.last = step if self.written_ok else self.last

    def figures(self) -> dict:
        return {
            "checkpoint_failures": self.failures,
            "checkpoints_written": self.written,
            "checkpoint_time_s": self.seconds,
        }
