"""The per-rank memory of a run, traced without a GPU (the command is `python -m sdp.estimate`).

`estimate(cfg, world_size=K, rank=R)` plays one rank of a K-worker job in this one
process and runs two training steps of the run's own code (config, DDP or
SDP strategy, optimizer, `train_step`) under FakeTensorMode with a fake
process group: tensors have shapes, dtypes and storages but no data, and no
collective moves anything. The first makes the gradients and optimizer state; the
second, in the steady state a run profiles (`trainer.profile_step`), runs under the
FLOP counter and the live-tensor tracker at once (a run counts them in two steps; the two
count the same, `sdp.metrics.flops.FlopTally`). It returns the same memory breakdown as a run's
`summary.json`, plus the communication bytes per step the rank would send. Under DDP the
strategy is the run's with `DDPBuckets`, the estimator's model of DDP's gradient buckets, in
place of DistributedDataParallel, whose reducer cannot run on fake tensors.

The optimizer is the one the run builds on the device it trains on (`target`, CUDA by
default: fused AdamW over dense tensors, else torch's foreach there; `_Run`), whose temporaries
differ from the CPU's per-tensor loop. Sizes are those of the configured dtypes (fp32 today)
and are the same on a CUDA device; the CUDA caching allocator adds its block rounding and
fragmentation on top (`max_memory_reserved`), which no trace can know.
Inputs are dummies of the configured shapes (micro-batch = global batch /
(K x accumulation steps), sequence length or image size), so no data is read.

With NCCL every process group a rank joins is a communicator with device
buffers of its own: the estimate counts them (the world, SDP's holder sets,
SDP x FSDP's mesh) and adds `parallelism.comm_group_overhead_mb` each to the
peak, shown apart, so that "does it fit" includes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time

import torch
import torch.distributed as torch_dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from sdp import dist
from sdp.errors import ConfigError
from sdp.metrics.comm import COMM_KINDS, CommCounter, wire_bytes
from sdp.metrics.flops import flop_counter
from sdp.metrics.memory import LivePeak, outer_keys
from sdp.models import build_model
from sdp.optim import build_optimizer
from sdp.outer import is_outer
from sdp.outer.algorithms import algorithm_of
from sdp.outer.loop import OuterLoop
from sdp.outer.view import LocalDDPStrategy, view_of
from sdp.parallel import ParallelConfig
from sdp.parallel.ddp import DDPStrategy
from sdp.planning.estimates import Estimate
from sdp.planning.ranks import planned_groups
from sdp.planning.segments import StepSegments
from sdp.run.build import build_strategy
from sdp.run.config import RunConfig
from sdp.run.nonfinite import NonFiniteGuard, skips_on_device
from sdp.run.trainer import train_step
from sdp.run.trainer_config import micro_batch_size
from sdp.subnet import is_sdp

GIB = 2**30


class EstimateError(RuntimeError):
    """The configured step could not be traced under FakeTensorMode."""


def dummy_batch(cfg: RunConfig, micro: int) -> dict:
    """Inputs and targets of the run's shapes (values are irrelevant: they are fake)."""
    if cfg.dataset.kind == "text":
        tokens = torch.randint(0, cfg.model.vocab_size, (micro, cfg.dataset.seq_len + 1))
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    size, classes = cfg.dataset.image_size, cfg.dataset.num_classes
    return {"inputs": torch.randn(micro, 3, size, size), "targets": torch.randint(0, classes, (micro,))}


class DDPBuckets:
    """The estimator's model of DDP's reducer under the strategy's settings
    (`gradient_as_bucket_view=True`, a communication hook, every parameter used), as DDP's
    documentation and Python source describe it. The reducer itself cannot run on fake
    tensors: after the first step it re-buckets, which reads tensor data.

    - Memory: the gradients live in flat bucket storage made when DDP is built: with
      find_unused_parameters=False, DDP's first layout is one bucket per dtype (it re-buckets
      after the first step into the same bytes). A gradient the backward makes afresh (after
      `zero_grad(set_to_none=True)`) is copied into its view of the bucket and replaced by it,
      as the reducer does.
    - Traffic: from the second step the reducer fills buckets in the order the gradients
      arrive, bucket_cap_mb each (the first too: DDP's smaller first bucket is only its
      default, and the strategy always gives a cap), and all-reduces each when it is full.
      Each is counted as `grad_sync` and, when a timeline is kept, recorded as an all-reduce
      of the world; backward() ends waiting for them all.
    - Under `no_sync()`, neither.
    """

    def __init__(self, model: torch.nn.Module, *, cap_mb: float, comm: CommCounter):
        self.comm, self.cap, self.filling, self.syncing = comm, int(cap_mb * 2**20), 0, True
        params = [p for p in model.parameters() if p.requires_grad]
        self.views: dict[torch.nn.Parameter, torch.Tensor] = {}
        for dtype in dict.fromkeys(p.dtype for p in params):
            members = [p for p in params if p.dtype == dtype]
            flat = torch.empty(sum(p.numel() for p in members), dtype=dtype, device=members[0].device)
            start = 0
            for p in members:
                self.views[p] = flat[start : start + p.numel()].view_as(p)
                start += p.numel()
        for p in params:
            p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, p: torch.nn.Parameter) -> None:
        if not self.syncing:
            return
        view = self.views[p]
        if p.grad is not view:
            view.copy_(p.grad)
            p.grad = view
        self.filling += p.numel() * p.element_size()
        if self.filling >= self.cap:
            self._all_reduce()

    def _all_reduce(self) -> None:
        if self.filling:
            self.comm.add("grad_sync", self.filling)
            self.comm.event("all_reduce", "grad_sync", self.filling, tuple(range(torch_dist.get_world_size())))
        self.filling = 0

    def end_backward(self) -> None:
        """The last micro-batch's backward is over: its last bucket goes, and backward() has
        waited for every bucket."""
        self._all_reduce()
        self.comm.need_pending(("grad_sync",))

    @contextlib.contextmanager
    def no_sync(self):
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True


class TracedDDP(DDPStrategy):
    """DDPStrategy on the plain model with `DDPBuckets` in place of DistributedDataParallel."""

    def wrap(self, model: torch.nn.Module, cfg: ParallelConfig, *, device, comm: CommCounter) -> torch.nn.Module:
        self.buckets = DDPBuckets(model, cap_mb=cfg.bucket_cap_mb, comm=comm)
        return model

    def no_sync(self):
        return self.buckets.no_sync()

    def after_backward(self) -> None:
        self.buckets.end_backward()
        super().after_backward()


def _materialize(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Give every meta parameter and buffer a storage (fake ones under FakeTensorMode), in
    place; tied tensors stay tied. (`Module.to_empty` cannot: it swaps tensors, which fake
    tensors refuse.)"""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
        return made[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = empty(t)
    return model


def estimate(cfg: RunConfig, *, world_size: int, rank: int, head: str | None = None, target: str = "cuda") -> Estimate:
    """Memory, FLOPs and communication of `rank` in a `world_size`-worker run of `cfg`; the
    peak of each segment of the step in `peak_segments` (sdp.planning.segments), the head's
    apart when `head` names the module where it begins. `target`: the device type the run
    trains on, "cuda" or "cpu": its optimizer is the one built there (`_Run`)."""
    start = time.perf_counter()
    with dist.fake_process_group(rank, world_size):
        run = _Run(cfg, world_size=world_size, rank=rank, target=target)
        est = run.measure(cfg, head=head)
    return dataclasses.replace(est, trace_s=round(time.perf_counter() - start, 2))


def _traceable(cfg: RunConfig) -> RunConfig:
    """`cfg` as a trace runs it: no host NaN check under fake tensors (it reads a value; `_Run`
    runs the device's check, which reads none, where the run has it), and eager: compiled
    blocks fuse elementwise work and keep fewer activations, so the estimate of a compiled run
    is an upper bound (dynamo does not trace under this fake mode)."""
    trainer = dataclasses.replace(cfg.trainer, on_nonfinite="off")
    return dataclasses.replace(cfg, trainer=trainer, parallelism=dataclasses.replace(cfg.parallelism, compile=False))


def run_key(cfg: RunConfig) -> str:
    """What a `_Run` is built from: the config but its batch (`measure` takes any micro-batch
    and accumulation)."""
    trainer = dataclasses.replace(_traceable(cfg).trainer, global_batch_size=0, grad_accum_steps=0)
    checked = cfg.trainer.on_nonfinite != "off"  # the device's check in the step, or none
    return f"{dataclasses.replace(_traceable(cfg), trainer=trainer)!r} checked={checked}"


@contextlib.contextmanager
def _one_line(cfg: RunConfig, *, rank: int, world_size: int):
    """Any failure to trace becomes one clear line (an EstimateError); a config's refusal stays
    itself."""
    try:
        yield
    except (ConfigError, EstimateError):
        raise
    except Exception as err:  # noqa: BLE001  (any tracing failure becomes one clear line)
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise EstimateError(
            f"cannot trace a training step of model={cfg.model.name} masking={cfg.masking.name} "
            f"as rank {rank} of {world_size}: {type(err).__name__}: {first}"
        ) from err


class _Run:
    """One rank of a run under FakeTensorMode, built in the fake process group that is open, and
    its first step made: it allocates what every later step finds (gradients, optimizer state;
    one micro-step does that as well as all of them, at a fraction of the trace). `measure` then
    traces its next step, at any micro-batch: a step after a measured one is the steady state too
    (a run's third step follows its second), so a run measured at several micro-batches builds
    and warms up once (`SteadyRuns`).

    Its optimizer is the one the run builds on `target` (sdp.optim.build_optimizer): on CUDA
    fused where every trained tensor is dense, else torch's default there, foreach (whose update
    makes temporaries the size of the state: a square root of every second moment at once); on
    the CPU torch's per-tensor loop, one tensor's temporaries at a time."""

    def __init__(self, cfg: RunConfig, *, world_size: int, rank: int, target: str = "cuda"):
        # parallelism.compile null: compiled on CUDA (sdp.parallel.compile); the trace runs eager
        self.compiled = bool(cfg.parallelism.compile) or (cfg.parallelism.compile is None and target == "cuda")
        checked = cfg.trainer.on_nonfinite != "off"
        cfg = _traceable(cfg)
        self.world_size, self.rank, self.device = world_size, rank, torch.device("cpu")
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.comm = CommCounter()
        self.timer = StepSegments(self.device)
        self.measured = False
        with _one_line(cfg, rank=rank, world_size=world_size):
            self.strategy = self._build(cfg)
            with self.fake:
                self.outer = outer_loop(cfg, self.strategy, comm=self.comm, device=self.device)
                on = torch.device(target)
                self.optimizer = build_optimizer(
                    self.strategy.trainable(), cfg.optim, device=on, default_foreach=on.type == "cuda"
                )
                # The NaN/Inf check the trainer runs on the device with a fused optimizer (it reads
                # nothing back: traceable); the host's check, which reads, is left out.
                self.guard = NonFiniteGuard("stop", max_skips=0, device=self.device)
                if not (checked and skips_on_device(self.optimizer)):
                    self.guard = None
                self.comm.timeline = []
                self._step(cfg, self._batches(cfg), accum=1)
        self.comm.discard_step()

    def _build(self, cfg: RunConfig):
        device, fake = self.device, self.fake

        def empty_build(model_cfg) -> torch.nn.Module:
            """The plain model with storages made by the active fake mode. Built on the meta
            device first: model constructors may read tensor values (timm's drop-path rates)."""
            with unset_fake_temporarily(), torch.device("meta"):
                model = build_model(model_cfg)
            return _materialize(model, device)

        def fake_build(model_cfg) -> torch.nn.Module:
            with fake:
                return empty_build(model_cfg)

        world = dist.World(rank=self.rank, local_rank=0, world_size=self.world_size)
        if not is_sdp(cfg.masking.name):
            # Under an outer loop DDP steps alone: no reducer to model.
            ddp = LocalDDPStrategy if is_outer(cfg.outer) else TracedDDP
            with fake:
                return build_strategy(cfg, world=world, device=device, comm=self.comm, build=empty_build, ddp=ddp)
        # The mask and layout are plain integer bookkeeping: they run outside the fake mode, on
        # the fake model's shapes.
        return build_strategy(cfg, world=world, device=device, comm=self.comm, build=fake_build)

    def _step(self, cfg: RunConfig, batches, accum: int | None = None) -> torch.Tensor:
        """One training step of `cfg` on `batches` (made before it, as a run's loader has them;
        at `accum` accumulation steps if given), inside the fake mode."""
        micro = micro_batch_size(cfg.trainer, world_size=self.world_size)
        run = dataclasses.replace(cfg.trainer, grad_accum_steps=accum or cfg.trainer.grad_accum_steps)
        loss = train_step(
            self.strategy,
            self.optimizer,
            batches,
            cfg=run,
            micro=micro,
            device=self.device,
            timer=self.timer,
            guard=self.guard,
        )
        if self.guard is not None:
            self.guard.forget()  # its records are read where a run reads them: never, in a trace
        return loss

    def _batches(self, cfg: RunConfig):
        return itertools.repeat(dummy_batch(cfg, micro_batch_size(cfg.trainer, world_size=self.world_size)))

    def measure(self, cfg: RunConfig, *, head: str | None = None) -> Estimate:
        """The next step of this run at `cfg`'s batch (its config but the batch is the run's)."""
        cfg, comm = _traceable(cfg), self.comm
        if self.measured:  # the step before is this step's warm-up now, as the first step was
            comm.timeline = [_issued_before(rec) for rec in comm.timeline]
        self.measured = True
        with _one_line(cfg, rank=self.rank, world_size=self.world_size), self.fake:
            batches = self._batches(cfg)
            flops, static, (peak, segments), timeline, per_step = _profiled_steps(
                self.strategy,
                self.optimizer,
                lambda: self._step(cfg, batches),
                comm,
                segments=self.timer,
                head=head,
                outer=self.outer,
            )
        syncs, sent, sync_segments = static.pop("syncs", (None, {}, None))
        ops = static.pop("ops")
        for kind, nbytes in sent.items():  # a window's syncs spread over its H steps: the run's mean per step
            per_step[kind] += nbytes / cfg.outer.sync_every
        groups = planned_groups(cfg, world_size=self.world_size)[self.rank]
        micro = micro_batch_size(cfg.trainer, world_size=self.world_size)
        return Estimate(
            **_describe(cfg, self.strategy, world_size=self.world_size, rank=self.rank, micro=micro),
            outer=_outer_figures(cfg, sent, syncs),
            memory=_memory(static, peak, groups=groups, group_mb=cfg.parallelism.comm_group_overhead_mb),
            peak_segments=segments,
            flops_per_step=flops,
            comm_bytes_per_step=sum(per_step.values()),
            comm_bytes_per_step_by_kind=per_step,
            sync_timelines=syncs,
            sync_segments=sync_segments,  # an outer sync's peak by moment, by kind (None without one)
            timeline=timeline,
            precision=cfg.parallelism.mixed_precision,
            trace_s=0.0,
            ops=ops,
            compiled=self.compiled,
        )


class SteadyRuns:
    """`estimate`, keeping the runs it traced for the next calls: a call for a run it holds (the
    same config but the batch, `run_key`) measures that run's next step at the new batch instead
    of building and warming up another (equal to a fresh trace, field by field but `trace_s`:
    tests/test_plan_traces.py). The planner's workers probe a structure at several micro-batches,
    so the warm-up, about 40% of a trace, is made once a structure. The fake process group of
    one rank and world stays open between calls (a call for another closes it, and every run
    kept), and so do the last `KEEP` runs; a run with an outer loop is not kept (its sync moves
    the window on). `with SteadyRuns() as trace:` closes them at the end; no other process
    group can be made in this process meanwhile."""

    KEEP = 4  # the walk alternates the 3- and 4-layer models of a structure

    def __init__(self):
        self._group = contextlib.ExitStack()
        self._at: tuple[int, int] | None = None  # the open group's (world, rank)
        self._runs: dict[str, _Run] = {}

    def __call__(self, cfg: RunConfig, *, world_size: int, rank: int, head: str | None = None) -> Estimate:
        start = time.perf_counter()
        if self._at != (world_size, rank):
            self.close()
            self._group.enter_context(dist.fake_process_group(rank, world_size))
            self._at = (world_size, rank)
        key = run_key(cfg)
        run = self._runs.pop(key, None) or _Run(cfg, world_size=world_size, rank=rank)
        est = run.measure(cfg, head=head)
        if run.outer is None:
            self._runs[key] = run
            while len(self._runs) > self.KEEP:
                del self._runs[next(iter(self._runs))]
        return dataclasses.replace(est, trace_s=round(time.perf_counter() - start, 2))

    def close(self) -> None:
        self._runs.clear()
        self._group.close()
        self._at = None

    def __enter__(self) -> SteadyRuns:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _describe(cfg: RunConfig, strategy, *, world_size: int, rank: int, micro: int) -> dict:
    """What run an estimate is of: model, masking (and the rank's capacity, the mask's holder
    counts), world, rank and shapes, and where an outer loop's state lives."""
    plan = getattr(strategy, "plan", None)  # SDP's: the mask's holders per unit
    return {
        "model": cfg.model.name,
        "masking": cfg.masking.name,
        "granularity": cfg.masking.granularity if is_sdp(cfg.masking.name) else None,
        "coverage": cfg.masking.coverage,
        "capacity": None if plan is None else plan.mask.capacity[plan.worker_of(rank)],
        "holders": None if plan is None else {k: plan.stats[f"holders_{k}"] for k in ("min", "mean", "max")},
        "world_size": world_size,
        "rank": rank,
        "micro_batch": micro,
        "seq_len": cfg.dataset.seq_len if cfg.dataset.kind == "text" else None,
        "n_params": strategy.full_params,
        # Where an outer loop's state lives: in the device's peaks, or in host memory beside them.
        "outer_on": ("device" if cfg.outer.backup_device == "device" else "host") if is_outer(cfg.outer) else None,
    }


def _outer_figures(cfg: RunConfig, sent: dict, syncs: list[list[dict]] | None) -> dict | None:
    """An outer loop's settings and what a window's syncs send: the payload by kind (`sent`), and
    the wire bytes of the exchanges (`sdp.metrics.comm.wire_bytes` of each outer_sync collective
    of the traced syncs' timelines). None without an outer loop."""
    if not is_outer(cfg.outer):
        return None
    records = [r for timeline in syncs or [] for r in timeline if r["kind"] == "outer_sync"]
    return {
        "name": str(cfg.outer.name),
        "sync_every": cfg.outer.sync_every,
        "fragments": cfg.outer.fragments,
        "bytes_per_sync": dict(sent),
        "wire_bytes_per_sync": sum(wire_bytes(r["op"], r["bytes"], len(r["ranks"])) for r in records),
    }


def outer_loop(cfg: RunConfig, strategy, *, comm: CommCounter, device: torch.device) -> OuterLoop | None:
    """The outer algorithm's loop over the traced strategy, started (theta_prev and the momentum made), as
    the run builds it; None without one."""
    if not is_outer(cfg.outer):
        return None
    cap = cfg.parallelism.bucket_cap_mb
    view = view_of(strategy, family=cfg.model.family, comm=comm, bucket_cap_mb=cap)
    algorithm = algorithm_of(cfg.outer.name)
    outer = algorithm.build(
        cfg.outer, view, device=device, comm=comm, max_steps=cfg.trainer.max_steps, bucket_cap_mb=cap
    )
    outer.start()
    return outer


class _SyncMarks(list):
    """An outer loop's trace (the collectives it records, in order) that also marks a live-peak
    tracker's segment where a sync moves on from its update to its refresh: the two moments a
    sync peaks at, each on a line in the depth of its own (sdp.planning.layered)."""

    def __init__(self, live: LivePeak):
        super().__init__()
        self.live = live

    def append(self, entry: tuple) -> None:
        super().append(entry)
        if entry[1] == "outer_refresh":
            self.live.mark("sync refresh")


def _traced_syncs(strategy, optimizer, outer: OuterLoop, comm: CommCounter) -> tuple[dict, list[list[dict]], dict]:
    """Each fragment's sync after a step (gradients still alive), traced: the peak of each of its
    segments, the largest over the fragments (each syncs alone, but at the end), every
    fragment's collectives (the step-time model's) and the bytes this rank sent in a window's
    syncs, by kind."""
    segments: dict[str, dict] = {}
    timelines = []
    for fragment in range(outer.cfg.fragments):
        comm.timeline = []
        with LivePeak(strategy.model, optimizer, outer.device_state()) as live:
            live.mark("sync update")
            outer.trace = _SyncMarks(live)
            outer.sync(fragment)
        outer.trace = None
        for name, peak in live.segments().items():
            if name != "step" and peak["total"] > segments.get(name, {"total": -1})["total"]:
                segments[name] = peak
        timelines.append(comm.timeline)
    comm.timeline = None
    sent = comm.discard_step()  # a window's bytes, not a step's
    return segments, timelines, sent


def _profiled_steps(
    strategy,
    optimizer,
    run_step,
    comm: CommCounter,
    *,
    segments: StepSegments,
    head: str | None,
    outer: OuterLoop | None = None,
) -> tuple[int, dict, tuple[dict, dict], list[dict], dict[str, float]]:
    """The step after the warm-up (`_Run`) gives the FLOPs and the live peak (as `measure_peak`
    measures it, with the peak of each segment that `segments`, the steps' timer, marks), and its
    ops in order with their launches, FLOPs and bytes (`static["ops"]`, an OpTape's). Its
    collectives are kept with the number of ops done when each is issued and needed (the
    step-time model), those it needs itself (issued in it or just before: `comm.timeline` holds the step
    before's, issued at no position). With an outer loop, its state joins the static bytes (and
    the peak, on the device) and a sync is traced after the step for its peak
    (`sync_peak_bytes`). Returns (FLOPs, static bytes, (peak by kind, peak by kind of each
    segment), timeline, bytes sent by kind)."""
    static = strategy.memory(optimizer)
    live = LivePeak(strategy.model, optimizer, outer.device_state() if outer else ())
    with flop_counter(tape=True) as counter, torch.compiler.set_stance("force_eager"):
        with live, segments.tracking(live, strategy.model, head, tape=counter.tape):
            comm.position = counter.tape.position
            run_step()
    comm.position, timeline = None, comm.timeline
    static["ops"] = counter.tape.to_json()
    step = comm.end_step()
    per_step = {kind: float(step.get(kind, 0)) for kind in COMM_KINDS}  # this step's, not a mean over the run's
    if outer is not None:  # the outer loop's state, and a sync's peak and collectives (a step's gradients alive)
        sync_segments, syncs, sent = _traced_syncs(strategy, optimizer, outer, comm)
        peak = max(p["total"] for p in sync_segments.values())
        static = {**static, **outer.memory(), "sync_peak_bytes": peak, "syncs": (syncs, sent, sync_segments)}
    needed = [rec for rec in timeline if rec["need"] is not None and rec["need"] >= 0]
    return int(counter.get_total_flops()), static, (live.breakdown(), live.segments()), needed, per_step


def _issued_before(rec: dict) -> dict:
    """A collective of the step before the measured one, as the warm-up's are: issued at no
    position of the measured step, and needed there or not at all (-1: needed before it)."""
    return {**rec, "issue": None, "need": None if rec["need"] is None else -1.0}


def _memory(static: dict, peak: dict, *, groups: int, group_mb: float) -> dict:
    """The estimate's memory: static bytes, the live peak, and the communicators' allowance (with
    NCCL each process group is a communicator with buffers of its own on the device)."""
    allowance = int(groups * group_mb * 2**20)
    return {
        **static,
        "peak_bytes": peak["total"],
        "peak_breakdown": peak,
        "comm_groups": groups,
        "comm_group_bytes": allowance,
        "peak_with_comm_groups_bytes": peak["total"] + allowance,
    }


def format_estimate(est: Estimate) -> str:
    """A human-readable block in GiB."""
    mem = est.memory
    static = mem["params_bytes"] + mem["grads_bytes"] + mem["optim_bytes"]
    variant = est.masking if est.masking == "none" else f"{est.masking}/{est.granularity}"
    share = "" if est.capacity in (None, est.coverage) else f" (this rank's capacity {est.capacity:g})"
    lines = [
        f"{est.model} ({est.n_params / 1e6:.1f}M params), masking={variant} C={est.coverage:g}{share}, "
        f"rank {est.rank} of {est.world_size}, micro-batch {est.micro_batch}"
        + (f" x {est.seq_len} tokens" if est.seq_len else ""),
        f"  static   params {mem['params_bytes'] / GIB:.3f}  grads {mem['grads_bytes'] / GIB:.3f}  "
        f"optimizer {mem['optim_bytes'] / GIB:.3f}  = {static / GIB:.3f} GiB",
        "  peak     "
        + "  ".join(f"{k} {v / GIB:.3f}" for k, v in mem["peak_breakdown"].items() if k != "total")
        + f"  = {mem['peak_bytes'] / GIB:.3f} GiB",
        f"  compute  {est.flops_per_step / 1e12:.3f} TFLOP/step; comm {est.comm_bytes_per_step / GIB:.3f} "
        f"GiB/step sent; traced in {est.trace_s:.1f} s",
        f"  groups   {mem['comm_groups']} process groups (NCCL communicators, the world included) x "
        f"{mem['comm_group_bytes'] / max(1, mem['comm_groups']) / 2**20:g} MiB = {mem['comm_group_bytes'] / GIB:.3f} "
        f"GiB; peak with them {mem['peak_with_comm_groups_bytes'] / GIB:.3f} GiB",
    ]
    if "outer_backup_bytes" in mem:
        keys = outer_keys(mem)  # theta_prev's first, then the algorithm's state's
        parts = " + ".join(f"{k[6:-6].replace('backup', 'theta_prev')} {mem[k] / GIB:.3f}" for k in keys)
        lines.append(
            f"  outer    {parts} = {sum(mem[k] for k in keys) / GIB:.3f} GiB on {est.outer_on}; a sync peaks at "
            f"{mem['sync_peak_bytes'] / GIB:.3f} GiB"
        )
    if est.holders is not None:
        h = est.holders
        lines.append(f"  holders  each unit held by {h['min']}..{h['max']} workers (mean {h['mean']:g})")
    return "\n".join(lines)


def format_ranks(results: list[Estimate]) -> str:
    """`rank=all`: every rank's figures side by side, and the busiest rank by peak, named."""
    lines = ["rank  capacity  static GiB  peak GiB  peak+groups GiB  comm GiB/step"]
    for est in results:
        mem = est.memory
        static = mem["params_bytes"] + mem["grads_bytes"] + mem["optim_bytes"]
        capacity = "-" if est.capacity is None else f"{est.capacity:g}"
        lines.append(
            f"{est.rank:>4}  {capacity:>8}  {static / GIB:>10.3f}  {mem['peak_bytes'] / GIB:>8.3f}  "
            f"{mem['peak_with_comm_groups_bytes'] / GIB:>15.3f}  {est.comm_bytes_per_step / GIB:>13.3f}"
        )
    busiest = max(results, key=lambda e: e.memory["peak_with_comm_groups_bytes"])
    lines.append(
        f"busiest: rank {busiest.rank} of {busiest.world_size}, peak "
        f"{busiest.memory['peak_with_comm_groups_bytes'] / GIB:.3f} GiB with its process groups"
    )
    return "\n".join(lines)
