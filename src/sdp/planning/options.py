"""The command line of the planner's two commands, `sdp.estimate` and `sdp.plan`: one parser.

Each command's own keys (`key=value`) are split from the run's overrides, which go on to the
config as `sdp.train` takes them; `cluster=NAME` with `cluster.KEY=VALUE` and `nodes=N` name the
machine the step is modelled on, alike in both. Every value is checked here, before any trace:
a bad one is one ConfigError naming its key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sdp.errors import ConfigError
from sdp.paths import check_writable
from sdp.planning.cores import default_workers
from sdp.planning.report import OBJECTIVES
from sdp.planning.space import CHECKPOINTING, PRECISIONS, parse_devices
from sdp.planning.step_time import Cluster, load_cluster, place
from sdp.planning.traces import default_dir

if TYPE_CHECKING:
    from sdp.planning.quality import TargetRanking

MAX_RANKS = 65536  # more than any cluster the step-time model describes
MAX_WORKERS = 256  # tracing processes
RANK_CHOICES = ("busiest", "all")
MIN_COVERAGE = 0.3  # the default: below it quality fell in our replica tables (claims.md, claim 4a)
MACHINE = ("cluster", "nodes")  # with cluster.KEY=VALUE, the machine's keys in both commands
ESTIMATE_KEYS = ("world_size", "rank", "out", *MACHINE)
PLAN_KEYS = (
    "devices", "objective", "min_coverage", "coverages", "granularity", "precision", "checkpointing",
    "top", "workers", "world_size", "out", "sync_every", "cache", "quality", *MACHINE,
)  # fmt: skip
CHOSEN = {  # what the planner chooses, refused on its command line, and the planner's key that narrows it
    "masking": "min_coverage=, coverages=, granularity=",
    "variant": "min_coverage=, coverages=, granularity=",
    "parallelism": "the table's FSDP rows",
    "parallelism.fsdp_degree": "the table's SDP x FSDP rows",
    "parallelism.activation_checkpointing": "checkpointing=",
    "parallelism.mixed_precision": "precision=",
    "trainer.grad_accum_steps": "the table's micro-batch column (trainer.global_batch_size= sets the batch)",
    "outer.sync_every": "sync_every=",
}


@dataclass
class CommandLine:
    own: dict[str, str]  # the command's own keys, as given
    overrides: list[str]  # the run's
    cluster: Cluster | None  # cluster=NAME, with its cluster.KEY=VALUE overrides
    nodes: int | None  # nodes=N (with cluster= only)


def split(argv: list[str], keys: tuple[str, ...], *, chosen: dict[str, str] | None = None) -> CommandLine:
    """The command's own `keys`, the machine, and the run's overrides; a key of `chosen` (the
    planner's to choose, a masking.* key among them) is refused with the key that narrows it."""
    own, overrides, cluster_keys = {}, [], {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in keys:
            own[key] = value
        elif sep and key.startswith("cluster."):
            cluster_keys[key.removeprefix("cluster.")] = value
        else:
            bare = key.lstrip("+~")
            picked = bare if bare in (chosen or {}) else "masking" if chosen and bare.startswith("masking.") else None
            if sep and picked is not None:
                raise ConfigError(key, value, f"is the planner's to choose; narrow it with {chosen[picked]}")
            overrides.append(arg)
    if "cluster" not in own:
        given = "nodes" if "nodes" in own else f"cluster.{next(iter(cluster_keys))}" if cluster_keys else None
        if given is not None:
            raise ConfigError("cluster", None, f"is required with {given}=: name the machine (cluster=NAME)")
        return CommandLine(own, overrides, None, None)
    cluster = load_cluster(own["cluster"], cluster_keys)
    nodes = integer("nodes", own["nodes"], 1, MAX_RANKS) if "nodes" in own else None
    return CommandLine(own, overrides, cluster, nodes)


def integer(key: str, value: str, lo: int, hi: int) -> int:
    if not value.strip().isdigit() or not lo <= int(value) <= hi:
        raise ConfigError(key, value, f"must be an integer in [{lo}, {hi}]")
    return int(value)


def number(key: str, value: str, lo: float, hi: float) -> float:
    try:
        found = float(value)
    except ValueError:
        found = None
    if found is None or not lo <= found <= hi:
        raise ConfigError(key, value, f"must be a number in [{lo:g}, {hi:g}]")
    return found


def choices(key: str, value: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    picked = tuple(v.strip() for v in value.split(","))
    if not all(picked) or not set(picked) <= set(allowed) or len(set(picked)) != len(picked):
        raise ConfigError(key, value, f"must be a comma list of {', '.join(allowed)}")
    return picked


@dataclass
class EstimateArgs:
    overrides: list[str]
    world_size: int
    rank: str  # an integer, busiest or all
    out: Path | None
    cluster: Cluster | None = None  # cluster=NAME: also model the step time there


def parse_estimate(argv: list[str]) -> EstimateArgs:
    """`sdp.estimate`'s world_size=, rank=, out= and machine; world_size= defaults to every device
    of nodes=N when cluster= names them."""
    line = split(argv, ESTIMATE_KEYS)
    own, cluster, nodes = line.own, line.cluster, line.nodes
    if "world_size" not in own and cluster is not None and nodes is not None:
        own["world_size"] = str(nodes * cluster.devices_per_node)  # every device of the nodes
    if "world_size" not in own:
        raise ConfigError("world_size", None, "is required: world_size=K, the number of workers to play")
    k = integer("world_size", own["world_size"], 1, MAX_RANKS)
    if cluster is not None:
        place(cluster, world_size=k, nodes=nodes)
    rank = own.get("rank", "busiest")
    if rank not in RANK_CHOICES and not (rank.isdigit() and int(rank) < k):
        raise ConfigError("rank", rank, f"allowed: an integer in [0, {k - 1}], {', '.join(RANK_CHOICES)}")
    return EstimateArgs(line.overrides, k, rank, Path(own["out"]) if own.get("out") else None, cluster)


def parse_against(argv: list[str]) -> tuple[Path, str, Path | None]:
    """`sdp.estimate --against RUN_DIR` (or --against=RUN_DIR), rank= and out=; anything else is
    refused: the run's own config is what is estimated."""
    run_dir, own, rest = None, {"rank": "all", "out": None}, list(argv)
    while rest:
        arg = rest.pop(0)
        key, sep, value = arg.partition("=")
        if arg == "--against":
            if not rest:
                raise ConfigError("--against", None, "needs a run dir: --against RUN_DIR")
            run_dir = rest.pop(0)
        elif key == "--against":
            run_dir = value
        elif sep and key in own:
            own[key] = value
        else:
            message = "is not taken with --against: the run's own config is estimated (allowed: rank=, out=)"
            raise ConfigError(key, value or None, message)
    if not run_dir:
        raise ConfigError("--against", run_dir, "needs a run dir: --against RUN_DIR")
    return Path(run_dir), own["rank"], Path(own["out"]) if own["out"] else None


@dataclass
class PlanArgs:
    overrides: list[str]
    devices: list[float]
    devices_text: str
    cluster: Cluster | None
    nodes: int
    objective: str
    min_coverage: float
    every: bool  # coverages=all
    granularities: tuple[str, ...] | None  # None: the default for the model
    precisions: tuple[str, ...]
    checkpointing: tuple[str, ...]
    sync_every: tuple[int, ...] | None  # the outer loop's H searched (None: not given; (): no outer loop)
    top: int
    workers: int
    out: Path | None
    cache: Path | None  # where traces are kept between calls (None: cache=off)
    quality: Path | None = None  # objective=time_to_target's pilot sweep (sdp.planning.quality)
    outer: str | None = None  # the user's outer algorithm (outer.name; None: none), once composed
    ranking: TargetRanking | None = None  # its ranking, once the pilot is read (`sdp.planning.planner.prepare`)


def parse_plan(argv: list[str]) -> PlanArgs:
    """`sdp.plan`'s own keys and machine; what the planner chooses is refused among the overrides."""
    line = split(argv, PLAN_KEYS, chosen=CHOSEN)
    own, cluster = line.own, line.cluster
    if "devices" not in own:
        raise ConfigError("devices", None, "is required: devices=8x80, [80,80,24,24] or 4x80+4x24 (GiB per GPU)")
    devices = parse_devices(own["devices"])
    world = len(devices)
    if "world_size" in own and own["world_size"] != str(world):
        raise ConfigError("devices", own["devices"], f"lists {world} GPUs, but world_size={own['world_size']}")
    nodes = _nodes(cluster, line.nodes, world, own["devices"]) if cluster is not None else 1
    objective = own.get("objective", "speed")
    if objective not in OBJECTIVES:
        raise ConfigError("objective", objective, f"allowed: {', '.join(OBJECTIVES)}")
    if objective in ("speed", "time_to_target") and cluster is None:
        why = f"is required for objective={objective} (the step time); or objective=memory"
        raise ConfigError("cluster", None, why)
    if (objective == "time_to_target") != ("quality" in own):
        if "quality" in own:
            raise ConfigError("quality", own["quality"], "is read with objective=time_to_target only")
        why = "is required for objective=time_to_target: a pilot sweep's collect CSV or folder of run dirs"
        raise ConfigError("quality", None, why)
    if own.get("coverages", "grid") not in ("grid", "all"):
        raise ConfigError("coverages", own["coverages"], "allowed: grid (0.75, 0.5, 0.25, 0.125), all (every r / K)")
    top = own.get("top", "20")
    return PlanArgs(
        line.overrides,
        devices,
        own["devices"],
        cluster,
        nodes,
        objective,
        number("min_coverage", own.get("min_coverage", str(MIN_COVERAGE)), 1e-6, 1),
        own.get("coverages") == "all",
        choices("granularity", own["granularity"], ("neuron", "block")) if "granularity" in own else None,
        choices("precision", own.get("precision", ",".join(PRECISIONS)), PRECISIONS),
        choices("checkpointing", own.get("checkpointing", ",".join(CHECKPOINTING)), CHECKPOINTING),
        _sync_every(own["sync_every"]) if "sync_every" in own else None,
        10**9 if top == "all" else integer("top", top, 1, 10**6),
        integer("workers", own.get("workers", str(min(MAX_WORKERS, default_workers()))), 1, MAX_WORKERS),
        Path(own["out"]) if "out" in own else None,
        _cache(own.get("cache")),
        Path(own["quality"]) if "quality" in own else None,
    )


def _nodes(cluster: Cluster, nodes: int | None, world: int, devices_text: str) -> int:
    """The nodes the plan's GPUs are on: whole nodes, as torchrun starts them."""
    place(cluster, world_size=world, nodes=nodes)
    per_node = cluster.ranks_per_node
    if world > per_node and world % per_node:  # torchrun starts as many ranks on every node
        fits = [n for n in range(2, world + 1) if world % n == 0 and world // n <= per_node]
        message = f"has {world} GPUs: not whole nodes of {per_node}; give nodes=N, N in {fits}"
        raise ConfigError("devices", devices_text, message)
    return max(1, world // per_node)


def _sync_every(value: str) -> tuple[int, ...]:
    picked = tuple(v.strip() for v in value.split(","))
    if not all(p.isdigit() and int(p) >= 1 for p in picked) or len(set(map(int, picked))) != len(picked):
        raise ConfigError("sync_every", value, "must be a comma list of distinct integers >= 1 (outer=diloco's H)")
    return tuple(map(int, picked))


def _cache(value: str | None) -> Path | None:
    """cache=: the folder for traces (the default's need not be writable: without it the plan is
    only slower), or None for off."""
    if value is None:
        return default_dir()
    if value == "off":
        return None
    if not value.strip():
        raise ConfigError("cache", value, "must be a folder, or off (trace everything)")
    check_writable("cache", Path(value))
    return Path(value)
