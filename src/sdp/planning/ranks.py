"""What a run's SDP plan says of its ranks before anything is traced: the busiest one, and the
process groups each joins. Built on the meta device from the config alone, so the planner reads
them without the tracing machinery of `sdp.planning.estimator` (FakeTensor, the FLOP counter,
DTensor, the training loop), which a call that reads its traces back never imports."""

from __future__ import annotations

from sdp.models import build_on_meta
from sdp.run.config import RunConfig
from sdp.subnet import is_sdp, sdp_workers
from sdp.subnet.plan import SubnetPlan, planned_comm_groups


def busiest_rank(cfg: RunConfig, *, world_size: int) -> int:
    """The rank holding the most unit parameters under the run's mask (0 under DDP); under
    SDP x FSDP, shard 0 of the busiest worker."""
    if not is_sdp(cfg.masking.name):
        return 0
    workers = sdp_workers(cfg.parallelism, masking=cfg.masking.name, world_size=world_size)
    plan = SubnetPlan.build(build_on_meta(cfg.model), cfg.masking, family=cfg.model.family, workers=workers)
    return busiest_of_plan(plan, world_size=world_size)


def busiest_of_plan(plan: SubnetPlan, *, world_size: int) -> int:
    """`busiest_rank` from the run's SDP plan (one the config's checks built)."""
    workers = plan.workers
    held = [
        sum(plan.mask.held_units(w, g).size * group.unit_numel(plan.shapes) for g, group in enumerate(plan.spec.groups))
        for w in range(workers)
    ]
    return max(range(workers), key=lambda w: held[w]) * (world_size // workers)


def planned_groups(cfg: RunConfig, *, world_size: int) -> list[int]:
    """The process groups (NCCL communicators) each rank of the run joins, the world included."""
    if not is_sdp(cfg.masking.name):
        return [1] * world_size
    workers = sdp_workers(cfg.parallelism, masking=cfg.masking.name, world_size=world_size)
    model = build_on_meta(cfg.model)
    fsdp = cfg.parallelism.fsdp_degree if cfg.parallelism.name == "fsdp" else 1
    return planned_comm_groups(
        model, cfg.masking, family=cfg.model.family, workers=workers, fsdp_degree=fsdp, steps=cfg.trainer.max_steps
    )
