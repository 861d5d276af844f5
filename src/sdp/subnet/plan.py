"""SDP's plan: what follows from the config and the world size alone, before any process group.

`SubnetPlan` is the units of a plain (or meta) model, the mask (epoch 0; later epochs on
request), the holder sets, the process groups every rank joins, and the checks made before a
launch (`validate_plan` returns the plan it checked, so a caller can hand it to the strategy
instead of computing it again). Everything here is a pure function of (model shapes, masking
config, K workers, F ranks per worker): every rank computes the same plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from sdp.errors import ConfigError
from sdp.models import blocks, build_on_meta
from sdp.parallel import ParallelConfig
from sdp.subnet import MaskingConfig, coverage_key
from sdp.subnet.capacity import capacity_mask, check_length
from sdp.subnet.groups import REPLICATED, joined, rank_sets, sdp_dimension_sets, shard_dims
from sdp.subnet.mask import FIXED_HOLDER_SETS, Mask, build_mask, holder_runs, mask_stats
from sdp.subnet.modes import mode_of
from sdp.subnet.units import UnitSpec, unit_spec


def plan_mask(
    model: nn.Module, cfg: MaskingConfig, *, family: str, world_size: int, fsdp_degree: int = 1
) -> tuple[UnitSpec, Mask]:
    """The unit spec and (epoch 0) mask of a plain model: a pure function of config and world size
    (K = `world_size` SDP workers; one capacity per worker, checked here once for every epoch)."""
    if cfg.capacity is not None:
        check_length(cfg.capacity, workers=world_size, fsdp_degree=fsdp_degree)
    spec = unit_spec(model, family=family, granularity=cfg.granularity)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    return spec, mask_of(spec, cfg, world_size=world_size, shapes=shapes)


def mask_of(
    spec: UnitSpec, cfg: MaskingConfig, *, world_size: int, shapes: Mapping[str, torch.Size], epoch: int = 0
) -> Mask:
    """The mask of mask epoch `epoch` (resampling draws a new one every masking.resample_every
    steps); `shapes`, the plain model's parameters, weigh the blocks of a capacity list (of one
    capacity per worker: `plan_mask` checks it)."""
    if cfg.capacity is not None:
        return capacity_mask(
            [g.num_units for g in spec.groups],
            capacity=cfg.capacity,
            construction=cfg.construction,
            seed=cfg.seed,
            group_kinds=[g.kind for g in spec.groups],
            group_names=[f"{g.name} ({g.kind})" if g.kind != "block" else g.name for g in spec.groups],
            unit_numels=[g.unit_numel(shapes) for g in spec.groups],
            epoch=epoch,
        )
    return build_mask(
        [g.num_units for g in spec.groups],
        num_workers=world_size,
        coverage=cfg.coverage,
        construction=cfg.construction,
        seed=cfg.seed,
        group_kinds=[g.kind for g in spec.groups],
        epoch=epoch,
    )


@dataclass(frozen=True, eq=False)
class SubnetPlan:
    """The units, the mask and the holder sets of K workers of F ranks each (rank k*F + f is
    shard f of worker k; F = 1 but under SDP x FSDP). Immutable; it keeps no model, only the
    plain model's parameter shapes and block paths."""

    cfg: MaskingConfig
    family: str
    workers: int  # K
    fsdp_degree: int  # F
    spec: UnitSpec
    mask: Mask  # epoch 0's
    shapes: Mapping[str, torch.Size]  # every parameter of the plain model, in its order
    block_paths: tuple[str, ...]

    @classmethod
    def build(
        cls, model: nn.Module, cfg: MaskingConfig, *, family: str, workers: int, fsdp_degree: int = 1
    ) -> SubnetPlan:
        """The plan of `model` (plain, on any device, the meta device included) for K = `workers`."""
        spec, mask = plan_mask(model, cfg, family=family, world_size=workers, fsdp_degree=fsdp_degree)
        shapes = {n: p.shape for n, p in model.named_parameters()}
        paths = tuple(path for path, _ in blocks(model, family=family))
        return cls(cfg, family, workers, fsdp_degree, spec, mask, shapes, paths)

    def mask_at(self, epoch: int) -> Mask:
        """The mask of mask epoch `epoch`."""
        return (
            self.mask
            if epoch == 0
            else mask_of(self.spec, self.cfg, world_size=self.workers, shapes=self.shapes, epoch=epoch)
        )

    def worker_of(self, rank: int) -> int:
        """The SDP worker (its index in the mask) that `rank` belongs to."""
        return rank // self.fsdp_degree

    @cached_property
    def stats(self) -> dict:
        """What summary.json reports about the (epoch 0) mask."""
        return mask_stats(self.mask, [g.unit_numel(self.shapes) for g in self.spec.groups])

    def record(self, epoch: int = 0) -> dict:
        """The mask of `epoch` as a run publishes it (RUN_DIR/mask.json): how it was made, its
        spectral gap, and every unit's holders (`holder_runs`), group by group."""
        mask = self.mask_at(epoch)
        stats = mask_stats(mask, [g.unit_numel(self.shapes) for g in self.spec.groups])
        return {
            "construction": self.cfg.construction,
            "seed": self.cfg.seed,
            "epoch": epoch,
            "resample_every": self.cfg.resample_every,
            "workers": self.workers,
            "holders_per_unit": mask.holders,
            "capacity": list(mask.capacity),
            "spectral_gap": stats["spectral_gap"],
            "groups": [
                {"name": g.name, "kind": g.kind, "units": g.num_units, "holders": holder_runs(mask, i)}
                for i, g in enumerate(self.spec.groups)
            ],
        }

    @cached_property
    def full_params(self) -> int:
        return sum(s.numel() for s in self.shapes.values())

    @cached_property
    def shared_params(self) -> int:
        return sum(self.shapes[n].numel() for n in self.spec.shared_params)

    @cached_property
    def position(self) -> dict[str, int]:
        """A tensor's place in the plain model (the order buckets are filled and launched in)."""
        return {n: i for i, n in enumerate(self.shapes)}

    @cached_property
    def block_of(self) -> dict[str, int]:
        """The block each parameter belongs to (-1: none)."""
        return block_index(self.shapes, self.block_paths)

    def enclosing_block(self, path: str) -> str:
        """The block `path` is in (itself when in none)."""
        return next((b for b in self.block_paths if path == b or path.startswith(b + ".")), path)

    @cached_property
    def shard_dims(self) -> dict[str, int | None]:
        """SDP x FSDP: the dimension FSDP shards each neuron-sliced parameter along (see groups.shard_dims)."""
        return shard_dims(self.spec, self.shapes, self.fsdp_degree)

    @cached_property
    def replicated(self) -> frozenset[str]:
        """SDP x FSDP: plain names of the parameters kept whole on each rank of a worker."""
        return frozenset(n for n, d in self.shard_dims.items() if d is REPLICATED)

    def comm_groups(self, *, steps: int = 0, stop_above: int | None = None) -> list[int]:
        """The process groups (with NCCL, communicators) each rank joins in a run of `steps` steps:
        the world, the groups of the holder sets of every mask epoch the run visits (a resample
        adds the new epoch's and keeps the old ones), and under SDP x FSDP (F > 1) the mesh's
        two. With `stop_above`, counting stops once a rank has more (for a refusal). What
        `SDPStrategy.comm_groups` reports at the end of such a run."""
        workers, f, cfg = self.workers, self.fsdp_degree, self.cfg
        replicated = f > 1 and bool(self.replicated)
        world = workers * f
        mesh = sum(1 for size in (workers, f) if size > 1) if f > 1 else 0
        every = cfg.resample_every
        # The cyclic and blocked constructions' holder sets are the same in every epoch (only the chunks move).
        epochs = (steps - 1) // every + 1 if every and steps > 1 and cfg.construction not in FIXED_HOLDER_SETS else 1
        # Under SDP x FSDP the mesh's sdp-dimension groups serve the holder set of every worker.
        meshed = set(sdp_dimension_sets(workers, fsdp_degree=f)) if f > 1 else set()
        holder_sets: set[tuple[int, ...]] = {tuple(range(workers))}
        for epoch in range(epochs):
            mask = self.mask_at(epoch)
            holder_sets |= set(mask.holder_sets())
            # Once every set of r workers has been drawn, later epochs add none (a long run, or
            # a typo of trainer.max_steps, need not draw them all).
            # (Only the random construction's sets change; it has r holders per unit.)
            everyone = math.comb(workers, mask.holders) + (mask.holders < workers) if mask.holders else 0
            saturated = len(holder_sets) >= everyone
            if stop_above is None and epoch < epochs - 1 and not saturated:
                continue
            sets = [hs for hs in rank_sets(holder_sets, fsdp_degree=f, replicated=replicated) if hs not in meshed]
            counts = [1 + mesh + joined(sets, rank=r, world_size=world) for r in range(world)]
            if saturated or (stop_above is not None and max(counts) > stop_above):
                break
        return counts

    def check(self, parallel: ParallelConfig, *, steps: int = 0) -> None:
        """The refusals before launch (ConfigError): a rank in more process groups than
        parallelism.max_comm_groups, a worker without a block (block units), and under forward
        masking a worker without a unit of some neuron group."""
        refusal = _too_many_groups(self, parallel, steps=steps)
        if refusal is not None:
            raise refusal
        if self.cfg.granularity == "block":
            _check_every_worker_holds_a_block(self)
        mode_of(self.cfg.name).check(self)


def planned_comm_groups(
    model: nn.Module,
    cfg: MaskingConfig,
    *,
    family: str,
    workers: int,
    fsdp_degree: int = 1,
    steps: int = 0,
    stop_above: int | None = None,
) -> list[int]:
    """`SubnetPlan.comm_groups` of `model`'s plan: the process groups each rank joins in a run of `steps` steps."""
    plan = SubnetPlan.build(model, cfg, family=family, workers=workers, fsdp_degree=fsdp_degree)
    return plan.comm_groups(steps=steps, stop_above=stop_above)


def validate_plan(model_cfg, cfg: MaskingConfig, *, world_size: int, parallel=None, steps: int = 0) -> SubnetPlan:
    """Check the mask against the model before launch (the model is built on the meta device),
    and the process groups it needs against parallelism.max_comm_groups. `world_size` is K, the
    SDP workers. Returns the plan (F = parallelism.fsdp_degree under parallelism=fsdp), which
    `SDPStrategy` and `ShardedSDPStrategy` accept as `plan=`."""
    parallel = parallel or ParallelConfig()
    model = build_on_meta(model_cfg)
    f = parallel.fsdp_degree if parallel.name == "fsdp" else 1
    plan = SubnetPlan.build(model, cfg, family=model_cfg.family, workers=world_size, fsdp_degree=f)
    plan.check(parallel, steps=steps)
    return plan


def _too_many_groups(plan: SubnetPlan, parallel: ParallelConfig, *, steps: int) -> ConfigError | None:
    """The refusal of a run whose busiest rank would join more than parallelism.max_comm_groups
    groups, or None."""
    cfg, workers = plan.cfg, plan.workers
    busiest = max(plan.comm_groups(steps=steps, stop_above=parallel.max_comm_groups))
    if busiest <= parallel.max_comm_groups:
        return None
    resampled = (
        cfg.resample_every and cfg.construction not in FIXED_HOLDER_SETS
    )  # counting stopped at the first epoch over
    if cfg.capacity is not None:  # the arcs' ends, mod 1, cut the circle into the holder sets
        key, value, at = "masking.capacity", cfg.capacity, f"capacities {cfg.capacity}"
        instead = "use capacities that are multiples of a common share (of 1/m: at most m holder sets)"
    else:
        key, value, at = "masking.construction", cfg.construction, f"C={cfg.coverage}"
        cyclic_cfg = dataclasses.replace(cfg, construction="cyclic")
        cyclic_plan = dataclasses.replace(
            plan, cfg=cyclic_cfg, mask=mask_of(plan.spec, cyclic_cfg, world_size=workers, shapes=plan.shapes)
        )
        cyclic = max(cyclic_plan.comm_groups(steps=steps))
        if cfg.construction != "cyclic" and cyclic <= parallel.max_comm_groups:
            instead = f"use masking.construction=cyclic ({cyclic} per rank here)"
        else:
            instead = "lower masking.coverage or use fewer workers"
    return ConfigError(
        key,
        value,
        f"makes the busiest rank join {'at least ' if resampled else ''}{busiest} process groups (the world "
        f"included) with K={workers} workers at {at}"
        + (f" and a new mask every {cfg.resample_every} steps" if resampled else "")
        + f", more than parallelism.max_comm_groups={parallel.max_comm_groups}; each is an NCCL communicator of "
        f"about {parallel.comm_group_overhead_mb:g} MiB of device memory (parallelism.comm_group_overhead_mb); "
        f"{instead}, or raise parallelism.max_comm_groups",
    )


def _check_every_worker_holds_a_block(plan: SubnetPlan) -> None:
    """Block masking: a worker that holds no block would train only the shared tensors while the
    run reports coverage C (either masking mode): refused."""
    spec, mask, k = plan.spec, plan.mask, plan.workers
    blocks = [g for g, group in enumerate(spec.groups) if group.kind == "block"]
    for worker in range(k):
        if blocks and not any(mask.held_units(worker, g).size for g in blocks):
            key, value = coverage_key(plan.cfg, worker)
            held_by = f"each held by {mask.holders} of {k} workers" if mask.holders else f"over {k} workers"
            raise ConfigError(
                key,
                value,
                f"leaves worker {worker} of {k} no block (the model has {len(blocks)}, {held_by}); raise "
                f"{'its capacity' if plan.cfg.capacity else 'the coverage'}, use fewer workers or "
                "masking.granularity=neuron",
            )


def block_index(names, paths) -> dict[str, int]:
    """Each plain tensor name's block: its index among the block `paths` (-1: in none)."""
    return {n: next((i for i, p in enumerate(paths) if n.startswith(p + ".")), -1) for n in names}
