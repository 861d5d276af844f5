"""The outer loop: local steps and an outer optimizer (DiLoCo, arXiv 2311.08105), over DDP and SDP.

`outer=none` is today's run: gradients averaged every step. `outer=diloco` lets each worker
take `sync_every` (H) inner steps alone, with its own inner optimizer state; then each
trained tensor's pseudo-gradient, Delta = theta_prev - theta_local, is averaged over the
workers that hold it (all of them under DDP; a unit's holders under SDP), and an outer Nesterov
SGD step moves theta_prev. `fragments` (Streaming DiLoCo, arXiv 2501.18512) splits the model
into P groups of consecutive blocks, synced one at a time, every H / P steps in turn.

The algorithms are plug-ins (`algorithms`: the registry, each with its config schema; `diloco`
the first); `loop` runs the syncs of any, `view` says what a strategy trains and with whom. This
module holds the checks every outer loop shares, and imports the built-in algorithms, which
register themselves. docs/lowcomm.md describes the design.
"""

from __future__ import annotations

from sdp.errors import ConfigError
from sdp.outer.algorithms import BackupDevice, OuterConfig, algorithm_of

__all__ = ["BackupDevice", "OuterConfig", "at_boundary", "check_resize", "is_outer", "validate_outer"]


def is_outer(cfg: OuterConfig) -> bool:
    return str(cfg.name) != "none"


def validate_outer(cfg: OuterConfig) -> None:
    """The checks on outer.* alone, by its algorithm (`sdp.outer.algorithms`; those against the
    model, the masking and the parallelism: `validate_outer_with`)."""
    algorithm = algorithm_of(cfg.name)
    if algorithm is not None:
        algorithm.validate(cfg)


def validate_outer_with(
    cfg: OuterConfig, *, parallelism: str, masking: str, resample_every: int, blocks: int, family: str
) -> None:
    """The outer loop's checks against the rest of the run: the parallelism it runs over, a mask
    that stays put (each unit's theta_prev and momentum live on its holders), and fragments no
    more than the model's `blocks`."""
    if not is_outer(cfg):
        return
    if parallelism != "ddp":
        raise ConfigError(
            "parallelism",
            parallelism,
            f"with outer={cfg.name}: the outer loop runs over parallelism=ddp (plain, or SDP's masking=backward or "
            "forward); FSDP shards every tensor over the ranks, so no rank holds a worker's whole tensors to step "
            "alone; allowed: parallelism=ddp",
        )
    if resample_every:
        raise ConfigError(
            "masking.resample_every",
            resample_every,
            f"with outer={cfg.name}: each unit's theta_prev and outer momentum live on its holders, and a "
            "resample would move them mid-window; must be 0",
        )
    if cfg.fragments > blocks:
        raise ConfigError(
            "outer.fragments",
            cfg.fragments,
            f"must be <= the model's {blocks} blocks ({family}): a fragment is a group of consecutive blocks",
        )


def at_boundary(cfg: OuterConfig, step: int) -> bool:
    """Whether every worker holds the synced weights after `step`: the start, or a whole-model
    sync (one fragment, `step` a multiple of H). Fragments sync in turn, so with P > 1 no step
    before the last is one. A run may change its world size only at a boundary: between two,
    each worker's weights and inner optimizer state are its own."""
    return not is_outer(cfg) or step == 0 or (cfg.fragments == 1 and step % cfg.sync_every == 0)


def check_resize(cfg: OuterConfig, *, run_dir: str, step: int, before: int, world_size: int) -> None:
    """A resume of `run_dir`'s checkpoint of `step`, written by `before` processes, on `world_size`:
    refused in one line naming the next boundary when the step is not one."""
    if before == world_size or at_boundary(cfg, step):
        return
    procs = f"{world_size} process{'es' if world_size != 1 else ''}"
    if cfg.fragments > 1:
        where = f"with outer.fragments={cfg.fragments} the fragments sync in turn, and no step before the last is one"
        then = f"resume on {before} processes"
    else:
        boundary = (step // cfg.sync_every + 1) * cfg.sync_every
        where = f"the next is step {boundary} (outer.sync_every={cfg.sync_every})"
        then = f"resume on {before} processes with trainer.stop_at_step={boundary}, then on {world_size}"
    raise ConfigError(
        "run_dir",
        run_dir,
        f"holds a checkpoint of step {step} written by {before} processes in the middle of an outer window: each "
        f"worker's weights and inner optimizer state are its own until the next sync, so a resume on {procs} "
        f"needs a sync boundary; {where}: {then}",
    )


# The built-in algorithms register themselves (after the names above, which they may import).
from sdp.outer import diloco, sparseloco  # noqa: E402, F401
