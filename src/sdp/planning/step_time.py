"""A step-time model of a training step on a cluster, from what the estimator traces.

The estimator runs a rank's real training step under FakeTensorMode and records
every collective the rank takes part in: its kind, payload, group, where the
compute stood when the collective could start (its issue point, in FLOPs done
so far in the step) and where the compute first needs its result (its need
point). This module turns that timeline into seconds on a described machine:

- compute: the step's ops in order (the trace's `ops`), each a kernel launch that the host
  issues in `launch_us` and the device runs in max(FLOPs / (peak x efficiency), bytes /
  memory bandwidth): a roofline, so a small matrix product runs below peak. The device starts
  an op when the host has issued it and the op before has ended (`compute_clock`), so a step of
  many small ops waits on the host. A compiled run's blocks fuse their elementwise work: its
  forward and backward ops that are not matrix products launch and move `compiled_fusion` of
  what they do eager. The other ops reach `memory_efficiency` of the bandwidth. A cluster
  without `launch_us` or `memory_bound_ops` (the CPU's, whose efficiency was measured over
  whole steps) charges FLOPs at `efficiency` alone;
- each collective: an alpha-beta model of NCCL's ring algorithms, on the
  slowest link its group spans (within a node or across nodes);
- the schedule: collectives run one at a time in issue order; each starts at
  its issue point (the compute's clock after the ops issued before it, or when the previous
  one ends) and the compute stalls at a need point until that collective has ended. The stalls are the exposed
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

import numpy as np
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
    # The host's time per kernel launch of an eager step (Python, the dispatcher, the launch):
    # a step of more launches than its device time allows waits on the host. 0: not charged.
    launch_us: float = 0.0
    # Each op also bounded by its bytes at memory_gbps x memory_efficiency (the roofline); false:
    # FLOPs alone (the CPU's calibration).
    memory_bound_ops: bool = False
    memory_efficiency: float = 1.0
    # A compiled run (parallelism.compile): the share of its eager forward's and backward's launches
    # and bytes of ops that are not matrix products that its fused kernels keep.
    compiled_fusion: float = 1.0
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
        if key == "memory_bound_ops":
            if str(value).lower() not in ("true", "false"):
                raise ConfigError(f"cluster.{key}", value, "must be true or false")
            raw[key] = str(value).lower() == "true"
            continue
        try:
            raw[key] = value if key in ("name", "description") else float(value)
        except ValueError:
            raise ConfigError(f"cluster.{key}", value, "must be a number") from None
    cluster = Cluster(**{k: raw[k] for k in raw if k in fields})
    cluster.devices_per_node = int(cluster.devices_per_node)
    if not 0 < cluster.efficiency <= 1:
        raise ConfigError("cluster.efficiency", cluster.efficiency, "must be in (0, 1]")
    if not 0 < cluster.memory_efficiency <= 1:
        raise ConfigError("cluster.memory_efficiency", cluster.memory_efficiency, "must be in (0, 1]")
    if not 0 < cluster.compiled_fusion <= 1:
        raise ConfigError("cluster.compiled_fusion", cluster.compiled_fusion, "must be in (0, 1]")
    if cluster.launch_us < 0:
        raise ConfigError("cluster.launch_us", cluster.launch_us, "must be >= 0")
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


@dataclass
class Compute:
    """A traced step's ops on a device (`compute_clock`): the device's clock at the end of each
    op, and the terms it is made of."""

    clock: list[float]  # seconds, at the end of each op
    launches: float  # kernel launches (a compiled run's fused ones fewer)
    launch_s: float  # the host's time issuing them
    flop_s: float  # the ops' FLOPs at peak x efficiency
    memory_s: float  # their bytes at the memory bandwidth (0: not charged)
    device_s: float  # each op's larger of the two, summed
    optimizer_s: float  # the clock's time in the optimizer phase
    micro_steps: list[float]  # each micro-step's time (its data, forward and backward phases), in order

    @property
    def host_wait_s(self) -> float:
        """Where the device waited for the host to issue its next op."""
        return (self.clock[-1] if self.clock else 0.0) - self.device_s

    def at(self, position: float) -> float:
        """The clock after the first `position` ops."""
        k = min(int(position), len(self.clock))
        return self.clock[k - 1] if k > 0 else 0.0


def compute_clock(
    ops: dict, cluster: Cluster, *, precision: str, compiled: bool = False, optimizer_bytes: float = 0.0
) -> Compute:
    """The device's clock over a traced step's ops (`Estimate.ops`): the host issues op i after
    launches_i x launch_us more; the device starts it when issued and when op i-1 has ended, and
    runs it in max(flops / (peak x efficiency), bytes / (memory bandwidth x memory_efficiency)).
    So end_i = max(end_{i-1}, host_i) + d_i, that is D_i + max over j <= i of (host_j - D_{j-1}),
    D the device times summed. A compiled run's forward and backward ops that are not matrix
    products (no FLOPs counted) launch and move `compiled_fusion` of their eager launches and
    bytes. Without `memory_bound_ops` (FLOPs alone) the optimizer phase ends with its
    `optimizer_bytes` of traffic at the memory bandwidth."""
    peak = 1e12 * (cluster.peak_tflops_bf16 if precision == "bf16" else cluster.peak_tflops_fp32)
    bandwidth = 1e9 * cluster.memory_gbps
    n, flops, nbytes = (np.asarray(ops[k], dtype=np.float64) for k in ("launches", "flops", "bytes"))
    phase = np.array(_phase_of(ops), dtype=object)
    if compiled:
        fused = np.isin(phase, ["forward", "backward"]) & (flops == 0)
        n, nbytes = (
            np.where(fused, n * cluster.compiled_fusion, n),
            np.where(fused, nbytes * cluster.compiled_fusion, nbytes),
        )
    f = flops / (peak * cluster.efficiency)
    m = nbytes / (bandwidth * cluster.memory_efficiency) if cluster.memory_bound_ops else np.zeros_like(f)
    optimizer = phase == "optimizer"
    if not cluster.memory_bound_ops and optimizer.any():  # FLOPs alone: the optimizer's traffic, at its end
        m[np.flatnonzero(optimizer)[-1]] += optimizer_bytes / bandwidth
    d = np.maximum(f, m)
    host, summed = np.cumsum(n * 1e-6 * cluster.launch_us), np.cumsum(d)
    ahead = np.maximum.accumulate(host - np.concatenate([[0.0], summed[:-1]])) if len(d) else d
    clock = summed + np.maximum(ahead, 0.0)
    spent = np.diff(np.concatenate([[0.0], clock]))
    micro = np.isin(phase, ["data", "forward", "backward"])
    starts = [start for name, start in ops["phases"] if name == "forward"] + [len(d)]  # a micro-step's first op
    micro_steps = [float(spent[a:b][micro[a:b]].sum()) for a, b in zip(starts, starts[1:], strict=False)]
    return Compute(
        clock=clock.tolist(),
        launches=float(n.sum()),
        launch_s=float(host[-1]) if len(host) else 0.0,
        flop_s=float(f.sum()),
        memory_s=float(m.sum()),
        device_s=float(d.sum()),
        optimizer_s=float(spent[optimizer].sum()),
        micro_steps=micro_steps,
    )


def phase_seconds(compute: Compute, ops: dict) -> dict[str, float]:
    """The clock's time in each phase of the step (the trainer's: data, forward, backward, sync,
    optimizer), as a GPU's timer of the phases measures it."""
    spent = np.diff(np.concatenate([[0.0], np.asarray(compute.clock)]))
    phase = np.array(_phase_of(ops), dtype=object)
    return {p: float(spent[phase == p].sum()) for p in dict.fromkeys(phase.tolist())}


def _phase_of(ops: dict) -> list[str]:
    """Each op's phase, from the run-length `phases`."""
    out, marks = [], ops["phases"] + [[None, len(ops["launches"])]]
    for (name, start), (_, end) in zip(marks, marks[1:], strict=False):
        out += [name] * (end - start)
    return out


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
    compute: Compute,
    cluster: Cluster,
    serial: bool = False,
) -> StepTime:
    """One step's time on `cluster`: its compute (`compute_clock`), plus the communication it
    could not hide. A collective's issue and need points are positions in the step's ops."""
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
        now = compute.at(position) + stall
        c = collectives[i]
        if not is_need:
            duration = collective_seconds(c, cluster)
            total += duration
            free = max(now, free) + duration
            ends[i] = free
        elif ends[i] > now:
            stall += ends[i] - now
            by_kind[c.kind] = by_kind.get(c.kind, 0.0) + ends[i] - now
    whole = compute.clock[-1] if compute.clock else 0.0
    hidden = total - stall  # communication that ran beside the compute
    step_s = whole + stall + cluster.comm_compute_share * hidden
    return StepTime(step_s, whole - compute.optimizer_s, compute.optimizer_s, stall, total, by_kind)


def step_times(est: Estimate, cluster: Cluster) -> dict:
    """An estimate's step on `cluster`, overlapped (as traced) and serial, in seconds, with the
    terms of its compute (`compute_clock`)."""
    if est.ops is None:
        raise ValueError("the step-time model needs a traced step's ops (Estimate.ops)")
    collectives = [
        Collective(r["op"], r["kind"], r["bytes"], tuple(r["ranks"]), max(0.0, r["issue"] or 0.0), r["need"])
        for r in est.timeline
    ]
    compute = compute_clock(
        est.ops, cluster, precision=est.precision, compiled=est.compiled, optimizer_bytes=optimizer_bytes(est.memory)
    )
    over = simulate(collectives, compute=compute, cluster=cluster)
    serial = simulate(collectives, compute=compute, cluster=cluster, serial=True)
    out = {
        "compute_s": over.compute_s,
        "optimizer_s": over.optimizer_s,
        "comm_s": over.comm_s,
        "exposed_serial_s": serial.exposed_comm_s,
        "exposed_overlapped_s": over.exposed_comm_s,
        "step_serial_s": serial.step_s,
        "step_overlapped_s": over.step_s,
        "exposed_by_kind_s": over.by_kind,
        # A micro-step that neither waits for the weight refresh (the first) nor packs gradient
        # buckets (the last): the cheapest traced one, what each added accumulation step costs.
        "micro_step_s": min(compute.micro_steps, default=0.0),
        "launches": compute.launches,
        "launch_s": compute.launch_s,
        "flop_s": compute.flop_s,
        "memory_s": compute.memory_s,
        "host_wait_s": compute.host_wait_s,
    }
    if est.sync_timelines:
        out.update(outer_sync_times(est, cluster, compute_s=over.compute_s))
        for key in ("step_serial_s", "step_overlapped_s"):  # the runtime waits for each sync
            out[key] += out["outer_sync_per_step_s"]
    return out


def optimizer_bytes(memory: dict) -> float:
    """Memory traffic of one AdamW/SGD step on a rank: its trainable weights read and written,
    their gradients read, the optimizer state read and written (from the estimator's static
    bytes; the gradients are as large as the trainable weights)."""
    return 3 * memory["grads_bytes"] + 2 * memory["optim_bytes"]


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


STEP_TERMS = ("launches", "launch_s", "flop_s", "memory_s", "host_wait_s")  # a step's compute terms


def step_terms(step: dict) -> str:
    """A step's compute terms in one line (`step_times`' keys)."""
    return (
        f"{step['launches']:,.0f} launches ({step['launch_s']:.4f} s of the host), FLOPs {step['flop_s']:.4f} s, "
        f"bytes {step['memory_s']:.4f} s, waiting for the host {step['host_wait_s']:.4f} s"
    )


def format_step_times(rows: list[dict], cluster: Cluster, *, world_size: int) -> str:
    """The rows of `step_times` as a table, with each step's ratio to the first row's (DDP's)."""
    per_node = cluster.ranks_per_node or cluster.devices_per_node
    nodes = -(-world_size // per_node)
    head = (
        f"step time on {cluster.name}: {world_size} ranks on {nodes} node(s) of {per_node}; matrix products at "
        f"{cluster.efficiency:g} x peak ({cluster.peak_tflops_bf16:g} TFLOP/s bf16, "
        f"{cluster.peak_tflops_fp32:g} fp32), "
        + (
            f"each op's bytes at {cluster.memory_gbps:g} GB/s x {cluster.memory_efficiency:g}, "
            if cluster.memory_bound_ops
            else ""
        )
        + (f"{cluster.launch_us:g} us a kernel launch, " if cluster.launch_us else "")
        + f"links {cluster.intra_node_gbps:g} GB/s within a node, {cluster.inter_node_gbps:g} GB/s across nodes"
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
        lines.append(f"    compute: {step_terms(r)}")
        if "outer_sync_window_s" in r:
            window, per_step = r["outer_sync_window_s"], r["outer_sync_per_step_s"]
            beside = r["outer_sync_overlapped_per_step_s"]
            lines.append(
                f"    outer syncs: {window:.4f} s a window, {per_step:.4f} s/step in the steps above "
                f"({beside:.4f} if each fragment's sync ran beside the next steps)"
            )
    return "\n".join(lines) + "\n  (seconds per step; exposed: the communication the compute waits for)"
