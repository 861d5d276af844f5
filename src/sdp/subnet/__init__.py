"""Subnetwork Data Parallelism (arXiv 2507.09029): units -> mask -> apply -> sync -> assemble.

`masking=none` is plain DDP. `masking=backward` and `masking=forward` give each
worker a structured subnetwork at `granularity` neuron or block, holding a
fraction `coverage` of the units; a unit's gradient is averaged among its
holders only.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from sdp.errors import ConfigError
from sdp.parallel.config import ParallelConfig
from sdp.subnet.mask import Construction
from sdp.subnet.units import Granularity

# masking.name: none (DDP), an SDP mode of `sdp.subnet.modes` (backward, forward, and any other
# registered), or a baseline: DDP with SDP's units dropped at random (sdp.subnet.baselines).
BASELINE_NAMES = ("dropout", "stochastic_depth")  # their objects: sdp.subnet.baselines.BASELINES


def masking_names() -> list[str]:
    """Every masking.name a run may give, in the order errors list them."""
    from sdp.subnet.modes import MODES  # noqa: PLC0415 (modes imports this package's names)

    return ["none", *MODES, *BASELINE_NAMES]


def is_sdp(masking: str) -> bool:
    """Whether `masking` (masking.name) trains subnetworks, a mode of `sdp.subnet.modes` (the
    others hold the whole model)."""
    from sdp.subnet.modes import MODES  # noqa: PLC0415 (modes imports this package's names)

    return str(masking) in MODES


def sdp_workers(parallel: ParallelConfig, *, masking: str, world_size: int) -> int:
    """K, the number of SDP workers: the world, or world / F under SDP x FSDP."""
    return world_size // parallel.fsdp_degree if parallel.name == "fsdp" and is_sdp(masking) else world_size


def validate_sdp_x_fsdp(parallel: ParallelConfig, *, masking: str, world_size: int) -> None:
    """The checks on parallelism.* that depend on the masking: FSDP under SDP, whose shard
    groups (parallelism.fsdp_degree, F) host forward masking's subnetworks only. Run after
    `validate_parallel` (F >= 1)."""
    sharded = parallel.name == "fsdp" and is_sdp(masking)
    if parallel.fsdp_degree > 1 and not sharded:
        raise ConfigError(
            "parallelism.fsdp_degree",
            parallel.fsdp_degree,
            f"is the shard group of each SDP worker and applies only to parallelism=fsdp with masking=forward "
            f"(here parallelism={parallel.name}, masking={masking}; plain FSDP shards over all ranks); allowed: 1",
        )
    if not sharded:
        return
    if not _mode(masking).shards:
        raise ConfigError(
            "parallelism",
            parallel.name,
            f"with masking={masking}: SDP x FSDP needs masking=forward (backward masking trains views "
            "into full weights on every rank, which FSDP's shards cannot host); allowed: parallelism=ddp",
        )
    if world_size % parallel.fsdp_degree:
        raise ConfigError(
            "parallelism.fsdp_degree",
            parallel.fsdp_degree,
            f"must divide the world size {world_size} (world = SDP workers x fsdp_degree)",
        )


class Scale(StrEnum):
    auto = "auto"
    inverse_coverage = "inverse_coverage"
    eval_coverage = "eval_coverage"
    none = "none"


@dataclass
class MaskingConfig:
    name: str = "none"  # one of masking_names()
    granularity: Granularity = Granularity.neuron
    coverage: float = 1.0  # fraction of units each worker holds
    # Each worker's own fraction, one per SDP worker (workers of different memory; sdp.subnet.capacity).
    # When given, it replaces `coverage`, which becomes the capacities' mean. None: every worker has `coverage`.
    capacity: list[float] | None = None
    construction: Construction = Construction.cyclic
    seed: int = 0  # the mask's seed (random construction), the same on every rank
    # Forward masking's rescaling, so that the full model used for evaluation sees
    # activations of the size the subnetworks were trained with:
    #   inverse_coverage: in training, a site's output x (units at the site / units held),
    #                     like inverted dropout; the full model is evaluated as is;
    #   eval_coverage:    training unscaled; in evaluation each unit site's output x C,
    #                     as stochastic depth scales a block by its survival rate at test time;
    #   none;  auto: inverse_coverage for neurons, eval_coverage for blocks.
    scale: Scale = Scale.auto
    # Before each evaluation, recompute the evaluated model's BatchNorm statistics
    # on this many training batches per rank (averaged over ranks); 0: off. Forward
    # masking needs it (masking/forward.yaml: 20): each holder measured its units'
    # statistics inside its own subnetwork, which the assembled model's activations
    # no longer match (the recalibration of slimmable / once-for-all networks).
    # Every other mode may set it too (the replica tables do): it then evaluates
    # the average of every rank's statistics of the final weights, not rank 0's
    # running average over its recent batches. A model without BatchNorm ignores it.
    bn_recalibration_batches: int = 0
    # Draw a new mask every this many optimizer steps (IST-style; 0: one mask for the
    # whole run). Units' weights and optimizer state move from their old holders to
    # their new ones, so training continues exactly where it was, on new subnetworks.
    resample_every: int = 0


def validate_masking(cfg: MaskingConfig) -> None:
    """Checks on the masking values alone (the mask itself is checked against the model before launch)."""
    if cfg.name not in masking_names():
        raise ConfigError("masking.name", cfg.name, f"allowed: {', '.join(masking_names())}")
    if cfg.capacity is not None:  # first: the coverage is then the capacities' mean, not the user's
        _validate_capacity(cfg)
    if not 0.0 < cfg.coverage <= 1.0:
        raise ConfigError("masking.coverage", cfg.coverage, "must be in (0, 1]")
    if cfg.name == "none" and cfg.coverage != 1.0:
        raise ConfigError("masking.coverage", cfg.coverage, "masking=none holds every unit: coverage must be 1.0")
    if cfg.seed < 0:  # numpy's generators take no negative seed
        raise ConfigError("masking.seed", cfg.seed, "must be in [0, 2**63 - 1]")
    if cfg.bn_recalibration_batches < 0:
        raise ConfigError("masking.bn_recalibration_batches", cfg.bn_recalibration_batches, "must be >= 0 (0: off)")
    if cfg.resample_every < 0:
        raise ConfigError("masking.resample_every", cfg.resample_every, "must be >= 0 (0: never resample)")
    if not (is_sdp(cfg.name) and _mode(cfg.name).scaled) and cfg.scale != "auto":  # it would be ignored: refused
        raise ConfigError(
            "masking.scale", cfg.scale, f"applies only to masking=forward (masking={cfg.name} trains unscaled)"
        )
    if not is_sdp(cfg.name) and cfg.resample_every:
        raise ConfigError(
            "masking.resample_every", cfg.resample_every, f"masking={cfg.name} has no mask to resample: must be 0"
        )


def _mode(masking: str):
    from sdp.subnet.modes import mode_of  # noqa: PLC0415 (modes imports this package's names)

    return mode_of(masking)


def _validate_capacity(cfg: MaskingConfig) -> None:
    """masking.capacity's own checks (its length and what the model's units allow are checked
    with the world size and the model: sdp.subnet.capacity)."""
    if not is_sdp(cfg.name):
        raise ConfigError(
            "masking.capacity", cfg.capacity, f"applies only to SDP (masking=backward|forward; here {cfg.name})"
        )
    if not cfg.capacity:
        raise ConfigError("masking.capacity", cfg.capacity, "must list one capacity per worker, each in (0, 1]")
    for i, c in enumerate(cfg.capacity):  # a nested list passes the typed config's check
        if isinstance(c, bool) or not isinstance(c, int | float):
            raise ConfigError(f"masking.capacity[{i}]", c, "must be a number in (0, 1], a worker's share of the units")
    bad = [c for c in cfg.capacity if not 0.0 < c <= 1.0]
    if bad:
        raise ConfigError(
            "masking.capacity", cfg.capacity, f"has {bad[0]:g}: each worker's share of the units must be in (0, 1]"
        )


def coverage_key(cfg: MaskingConfig, worker: int | None = None) -> tuple[str, object]:
    """The key and value an error about the units a worker holds names: masking.capacity (the
    worker's entry, where one is named) when capacities are given, else masking.coverage."""
    if cfg.capacity is None:
        return "masking.coverage", cfg.coverage
    if worker is None:
        return "masking.capacity", cfg.capacity
    return f"masking.capacity[{worker}]", cfg.capacity[worker]


def capacity_replaces_coverage(cfg: MaskingConfig, *, given_coverage: str | None = None) -> None:
    """masking.capacity replaces masking.coverage, which becomes the capacities' mean (what the
    run reports, the flop-matched protocol divides by, and the record holds); a coverage given
    too (`given_coverage`, as typed) that says otherwise is refused. The run's config and the
    planner's structures both go through here. A capacity list that is not numbers in (0, 1] is
    left for validate_masking to refuse."""
    capacity = cfg.capacity
    numbers = all(isinstance(c, int | float) and not isinstance(c, bool) for c in capacity or [])
    if not capacity or not numbers or not all(0 < c <= 1 for c in capacity):
        return
    mean = capacity_coverage(cfg)
    if given_coverage is not None and _as_float(given_coverage) != mean:
        raise ConfigError(
            "masking.coverage",
            given_coverage,
            f"contradicts masking.capacity={capacity}, whose mean {mean:g} is the run's coverage; give one of the two",
        )
    cfg.coverage = mean


def _as_float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def capacity_coverage(cfg: MaskingConfig) -> float:
    """The run's coverage: the capacities' mean when masking.capacity is given, else masking.coverage."""
    if cfg.capacity is None:
        return cfg.coverage
    return round(sum(cfg.capacity) / len(cfg.capacity), 9)


def resolved_scale(cfg: MaskingConfig) -> str:
    if cfg.scale != "auto":
        return cfg.scale
    return "inverse_coverage" if cfg.granularity == "neuron" else "eval_coverage"
