"""A step-time model of a training step on a cluster, from what the estimator traces.

The estimator runs a rank's real training step under FakeTensorMode and records
every collective the rank takes part in: its kind, payload, group, where the
compute stood when the collective could start (its issue point, in FLOPs done
so far in the step) and where the compute first needs its result (its need
point). This module turns that timeline into seconds on a described machine:

- compute: FLOPs / (peak FLOP/s x efficiency), plus the optimizer's memory
  traffic at the device's memory bandwidth;
- each collective: an alpha-beta model of NCCL's ring algorithms, on the
  slowest link its group spans (within a node or across nodes);
- the schedule: collectives run one at a time in issue order; each starts at
  its issue point (or when the previous one ends) and the compute stalls at a
  need point until that collective has ended. The stalls are the exposed
  communication. Where communication shares the compute's cores (a CPU), the
  communication hidden behind the compute still slows it by
  `comm_compute_share` of its duration.

`serial` replays the same collectives with every one issued at its need point
(nothing overlaps), which is `parallelism.overlap_comm=false` for SDP and the
cost of each communication in full.

FSDP's all-gathers are issued by the host at the block that needs them, but
FSDP2 runs them on a stream of their own one block ahead; the model starts an
all-gather at the need point of the one before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import OmegaConf

from sdp.errors import ConfigError
from sdp.paths import CONF_DIR
from sdp.planning.estimates import Estimate

CLUSTER_DIR = CONF_DIR / "cluster"


@dataclass
class Cluster:
    """A machine: devices, their compute, and the links between them (see conf/cluster/*.yaml)."""

    name: str
    devices_per_node: int
    peak_tflops_bf16: float
    peak_tflops_fp32: float
    efficiency: float  # the share of peak the compute reaches (model FLOPs utilisation)
    memory_gbps: float  # device memory bandwidth (the optimizer step is bound by it)
    intra_node_gbps: float  # bus bandwidth per device of a collective within a node
    intra_node_latency_us: float  # per ring step
    inter_node_gbps: float  # per device, across nodes
    inter_node_latency_us: float
    description: str = ""
    # A broadcast's latency per hop and bandwidth where they differ from the ring's (gloo's
    # broadcast is a few times cheaper than one step of its all-reduce); None: the link's.
    broadcast_latency_us: float | None = None
    broadcast_gbps: float | None = None
    # The compute's slowdown per second of communication running beside it: 0 where links
    # and compute are separate engines (GPUs; NCCL's kernels take a few SMs), large where
    # the same CPU cores do both.
    comm_compute_share: float = 0.0
    ranks_per_node: int = 0  # how the run's ranks sit on the nodes (set by `place`; 0: devices_per_node)


def cluster_names() -> list[str]:
    return sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml"))


def place(cluster: Cluster, *, world_size: int, nodes: int | None) -> None:
    """Spread `world_size` ranks over `nodes` nodes (rank r on node r // (ranks per node)), or
    fill nodes of `devices_per_node` devices when `nodes` is not given."""
    if nodes and world_size % nodes:  # torchrun starts the same number of ranks on every node
        fits = [n for n in range(1, world_size + 1) if world_size % n == 0]
        raise ConfigError(
            "nodes", nodes, f"must divide world_size={world_size} (the same ranks on every node); allowed: {fits}"
        )
    per_node = world_size // nodes if nodes else cluster.devices_per_node
    if per_node > cluster.devices_per_node:
        raise ConfigError(
            "nodes",
            nodes,
            f"puts {per_node} ranks on a node of {cluster.devices_per_node} devices ({cluster.name}); "
            f"allowed: {-(-world_size // cluster.devices_per_node)} nodes or more",
        )
    cluster.ranks_per_node = per_node


def load_cluster(name: str, overrides: dict[str, str] | None = None) -> Cluster:
    """conf/cluster/NAME.yaml with `cluster.KEY=VALUE` overrides (e.g. a measured efficiency)."""
    path = CLUSTER_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError("cluster", name, f"unknown cluster; allowed: {', '.join(cluster_names())}")
    raw = OmegaConf.load(path)
    fields = Cluster.__dataclass_fields__
    for key, value in (overrides or {}).items():
        if key not in fields:
            raise ConfigError(f"cluster.{key}", value, f"no such key; allowed: {', '.join(sorted(fields))}")
        try:
            raw[key] = value if key in ("name", "description") else float(value)
        except ValueError:
            raise ConfigError(f"cluster.{key}", value, "must be a number") from None
    cluster = Cluster(**{k: raw[k] for k in raw if k in fields})
    cluster.devices_per_node = int(cluster.devices_per_node)
    if not 0 < cluster.efficiency <= 1:
        raise ConfigError("cluster.efficiency", cluster.efficiency, "must be in (0, 1]")
    return cluster


@dataclass(frozen=True)
class Collective:
    """One collective of the traced step, as the traced rank took part in it."""

    op: str  # all_reduce | broadcast | all_gather | reduce_scatter
    kind: str  # the communication kind (grad_sync, weight_refresh, ...)
    nbytes: int  # the rank's payload (all_gather: its input shard)
    ranks: tuple[int, ...]  # the group
    issue: float  # FLOPs done in the step when it can start
    need: float  # FLOPs done when the compute needs its result


def collective_seconds(c: Collective, cluster: Cluster) -> float:
    """An alpha-beta model of NCCL's ring algorithms (n ranks, payload B per rank):
    all-reduce 2(n-1) steps moving 2(n-1)/n B; reduce-scatter and all-gather n-1 steps
    moving (n-1)/n of the full buffer; broadcast pipelined along the ring: n-1 latencies
    and B once."""
    n = len(c.ranks)
    if n < 2:
        return 0.0
    per_node = cluster.ranks_per_node or cluster.devices_per_node
    across = len({r // per_node for r in c.ranks}) > 1
    gbps = cluster.inter_node_gbps if across else cluster.intra_node_gbps
    alpha = 1e-6 * (cluster.inter_node_latency_us if across else cluster.intra_node_latency_us)
    beta = 1e9 * gbps
    if c.op == "all_reduce":
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * c.nbytes / beta
    if c.op == "reduce_scatter":
        return (n - 1) * alpha + (n - 1) / n * c.nbytes / beta
    if c.op == "all_gather":
        return (n - 1) * alpha + (n - 1) * c.nbytes / beta
    if c.op == "broadcast":
        hop = alpha if cluster.broadcast_latency_us is None else 1e-6 * cluster.broadcast_latency_us
        gbps = beta if cluster.broadcast_gbps is None else 1e9 * cluster.broadcast_gbps
        return (n - 1) * hop + c.nbytes / gbps
    raise ValueError(f"unknown collective {c.op!r}")


@dataclass
class StepTime:
    step_s: float
    compute_s: float
    optimizer_s: float
    exposed_comm_s: float
    comm_s: float  # every collective's time, hidden or not
    by_kind: dict[str, float] = field(default_factory=dict)  # exposed seconds by kind


def _prefetched(collectives: list[Collective]) -> list[Collective]:
    """FSDP's all-gathers start one block ahead: at the need point of the one before."""
    out, previous_need = [], 0.0
    for c in sorted(collectives, key=lambda c: c.need):
        if c.op == "all_gather" and c.kind == "param_all_gather":
            c = Collective(c.op, c.kind, c.nbytes, c.ranks, min(c.issue, previous_need), c.need)
            previous_need = c.need
        out.append(c)
    return out


def simulate(
    collectives: list[Collective],
    *,
    step_flops: float,
    optimizer_bytes: float,
    cluster: Cluster,
    precision: str,
    serial: bool = False,
) -> StepTime:
    """One step's time on `cluster`: compute, plus the communication it could not hide."""
    peak = 1e12 * (cluster.peak_tflops_bf16 if precision == "bf16" else cluster.peak_tflops_fp32)
    rate = peak * cluster.efficiency  # FLOPs per second of compute
    optimizer_s = optimizer_bytes / (1e9 * cluster.memory_gbps)
    if serial:
        collectives = [Collective(c.op, c.kind, c.nbytes, c.ranks, c.need, c.need) for c in collectives]
    else:
        collectives = _prefetched(collectives)
    # Events in compute order; at one point, issues come before needs (a collective issued
    # and waited for at once is fully exposed, not skipped).
    events = sorted(
        [(c.issue, 0, i) for i, c in enumerate(collectives)] + [(c.need, 1, i) for i, c in enumerate(collectives)]
    )
    stall, free, ends, by_kind, total = 0.0, 0.0, {}, {}, 0.0
    for position, is_need, i in events:
        now = position / rate + stall
        c = collectives[i]
        if not is_need:
            duration = collective_seconds(c, cluster)
            total += duration
            free = max(now, free) + duration
            ends[i] = free
        elif ends[i] > now:
            stall += ends[i] - now
            by_kind[c.kind] = by_kind.get(c.kind, 0.0) + ends[i] - now
    compute_s = step_flops / rate
    hidden = total - stall  # communication that ran beside the compute
    step_s = compute_s + optimizer_s + stall + cluster.comm_compute_share * hidden
    return StepTime(step_s, compute_s, optimizer_s, stall, total, by_kind)


def optimizer_bytes(memory: dict) -> float:
    """Memory traffic of one AdamW/SGD step on a rank: its trainable weights read and written,
    their gradients read, the optimizer state read and written (from the estimator's static
    bytes; the gradients are as large as the trainable weights)."""
    return 3 * memory["grads_bytes"] + 2 * memory["optim_bytes"]


def step_times(est: Estimate, cluster: Cluster) -> dict:
    """An estimate's step on `cluster`, overlapped (as traced) and serial, in seconds."""
    collectives = [
        Collective(r["op"], r["kind"], r["bytes"], tuple(r["ranks"]), max(0.0, r["issue"] or 0.0), r["need"])
        for r in est.timeline
    ]
    common = dict(
        step_flops=est.flops_per_step,
        optimizer_bytes=optimizer_bytes(est.memory),
        cluster=cluster,
        precision=est.precision,
    )
    over, serial = simulate(collectives, **common), simulate(collectives, serial=True, **common)
    out = {
        "compute_s": over.compute_s,
        "optimizer_s": over.optimizer_s,
        "comm_s": over.comm_s,
        "exposed_serial_s": serial.exposed_comm_s,
        "exposed_overlapped_s": over.exposed_comm_s,
        "step_serial_s": serial.step_s,
        "step_overlapped_s": over.step_s,
        "exposed_by_kind_s": over.by_kind,
    }
    if est.sync_timelines:
        out.update(outer_sync_times(est, cluster, compute_s=over.compute_s))
        for key in ("step_serial_s", "step_overlapped_s"):  # the runtime waits for each sync
            out[key] += out["outer_sync_per_step_s"]
    return out


def outer_sync_times(est: Estimate, cluster: Cluster, *, compute_s: float) -> dict:
    """An outer loop's syncs on `cluster`: each fragment's collectives one after another (the
    runtime waits for them after the step), a window's H steps sharing their time; and what a
    schedule that ran each fragment's sync beside the next H / P steps of compute (Streaming
    DiLoCo's overlap, which the runtime does not run) would leave exposed."""
    per_fragment = [
        sum(collective_seconds(Collective(r["op"], r["kind"], r["bytes"], tuple(r["ranks"]), 0.0, 0.0), cluster)
            for r in timeline)
        for timeline in est.sync_timelines
    ]  # fmt: skip
    return sync_figures(per_fragment, every=est.outer["sync_every"], compute_s=compute_s)


def sync_figures(per_fragment: list[float], *, every: int, compute_s: float) -> dict:
    """`outer_sync_times`' figures from each fragment's sync seconds, syncing every `every` steps
    of `compute_s` seconds of compute each."""
    between = every // len(per_fragment) * compute_s
    return {
        "outer_sync_fragments_s": per_fragment,
        "outer_sync_window_s": sum(per_fragment),
        "outer_sync_per_step_s": sum(per_fragment) / every,
        "outer_sync_overlapped_per_step_s": sum(max(0.0, t - between) for t in per_fragment) / every,
    }


def resync(step: dict, *, every: int) -> dict:
    """`step_times`' figures of a run with an outer loop, the same run syncing every `every` steps
    instead: nothing of a step but its share of the window's syncs depends on H."""
    figures = sync_figures(step["outer_sync_fragments_s"], every=every, compute_s=step["compute_s"])
    moved = figures["outer_sync_per_step_s"] - step["outer_sync_per_step_s"]
    return {**step, **figures, **{k: step[k] + moved for k in ("step_serial_s", "step_overlapped_s")}}


def format_step_times(rows: list[dict], cluster: Cluster, *, world_size: int) -> str:
    """The rows of `step_times` as a table, with each step's ratio to the first row's (DDP's)."""
    per_node = cluster.ranks_per_node or cluster.devices_per_node
    nodes = -(-world_size // per_node)
    head = (
        f"step time on {cluster.name}: {world_size} ranks on {nodes} node(s) of {per_node}; compute at "
        f"{cluster.efficiency:g} x peak ({cluster.peak_tflops_bf16:g} TFLOP/s bf16, "
        f"{cluster.peak_tflops_fp32:g} fp32), "
        f"links {cluster.intra_node_gbps:g} GB/s within a node, {cluster.inter_node_gbps:g} GB/s across nodes"
    )
    lines = [
        head,
        "  run                          compute  optimizer  comm     exposed serial / overlapped   "
        "step serial / overlapped   vs DDP (overlapped)",
    ]
    base = rows[0]["step_overlapped_s"]
    for r in rows:
        lines.append(
            f"  {r['run']:<28} {r['compute_s']:7.4f}  {r['optimizer_s']:9.4f}  {r['comm_s']:7.4f}  "
            f"{r['exposed_serial_s']:9.4f} / {r['exposed_overlapped_s']:<9.4f}        "
            f"{r['step_serial_s']:8.4f} / {r['step_overlapped_s']:<8.4f}     {r['step_overlapped_s'] / base:6.2f}"
        )
        if "outer_sync_window_s" in r:
            window, per_step = r["outer_sync_window_s"], r["outer_sync_per_step_s"]
            beside = r["outer_sync_overlapped_per_step_s"]
            lines.append(
                f"    outer syncs: {window:.4f} s a window, {per_step:.4f} s/step in the steps above "
                f"({beside:.4f} if each fragment's sync ran beside the next steps)"
            )
    return "\n".join(lines) + "\n  (seconds per step; exposed: the communication the compute waits for)"
