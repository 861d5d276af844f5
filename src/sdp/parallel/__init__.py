"""Data parallelism applied from outside the model.

The trainer talks to a `Strategy`: DDP (the baseline, `masking=none`) or SDP
(`sdp.subnet.SDPStrategy`). A strategy owns the model the trainer runs, the
tensors the optimizer updates, gradient synchronisation, clipping by the
global norm, what happens after an optimizer step, the full model used for
evaluation, and the per-rank byte counts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sdp.errors import ConfigError
from sdp.metrics.comm import CommCounter
from sdp.metrics.memory import static_bytes
from sdp.optim import hyperparameters, set_state, state_by_name


class Parallelism(StrEnum):
    ddp = "ddp"
    fsdp = "fsdp"  # FSDP2


class Checkpointing(StrEnum):
    """parallelism.activation_checkpointing, per block."""

    none = "none"
    full = "full"
    selective = "selective"


class Precision(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"


class CompileBackend(StrEnum):
    """parallelism.compile_backend: torch.compile's backend. inductor generates kernels;
    aot_eager runs the graphs inductor would be given with torch's own kernels (same bits as
    eager where the graph is the same: a check that the compiled graphs are right); eager only
    traces."""

    inductor = "inductor"
    aot_eager = "aot_eager"
    eager = "eager"


class Backend(StrEnum):
    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


@dataclass
class PortableState:
    """A run's trained state in the plain model's coordinates, the same whatever the world size
    and strategy that trained it: every model tensor (parameters and buffers) by plain name,
    every parameter's optimizer state by key and plain name, the scalar optimizer state (the
    step count) and the optimizer's group settings. What a checkpoint holds, and what a
    strategy re-cuts into its own pieces when it loads one."""

    model: dict[str, torch.Tensor]
    optim: dict[str, dict[str, torch.Tensor]]
    scalars: dict[str, torch.Tensor]
    groups: list[dict]

    def per_parameter(self, params: dict[str, torch.Tensor], place=lambda p, t: t) -> dict:
        """The optimizer state of `params` (plain name -> parameter), each value passed through
        `place` (cut into the parameter's shard); every parameter gets its own scalar copies
        (an optimizer steps them in place)."""
        out = {}
        for name, p in params.items():
            out[p] = {k: v.clone() for k, v in self.scalars.items()}
            out[p].update({k: place(p, per_name[name]) for k, per_name in self.optim.items()})
        return out


def host(t: torch.Tensor) -> torch.Tensor:
    """A detached host copy of `t` (never a view of the live tensor)."""
    return t.detach().to("cpu", copy=True)


def rank0_buffers(model: nn.Module, full=lambda t: t) -> dict[str, torch.Tensor]:
    """Collective: `model`'s state dict on the host, its tensors passed through `full`
    (unsharded), its buffers as rank 0 holds them (each rank's BatchNorm statistics saw its
    own batches; rank 0's are the ones evaluation uses)."""
    buffers = {n for n, _ in model.named_buffers()}
    out = {}
    for name, t in model.state_dict().items():
        if name in buffers:
            t = t.detach().clone()
            dist.broadcast(t, src=0)
        out[name] = host(full(t))
    return out


@dataclass
class ParallelConfig:
    name: Parallelism = Parallelism.ddp
    backend: Backend = Backend.auto
    bucket_cap_mb: float = 25  # MiB
    # SDP: average gradients in buckets launched during the backward (post-accumulate-grad
    # hooks, one global launch order) and overlap backward masking's weight refresh with the
    # next forward; false: both after the compute, one bucket at a time (the reference).
    overlap_comm: bool = True
    # What one process group costs a rank on the device with NCCL (its communicator's buffers):
    # 544-688 MiB measured on 4 A100s with NVLink (NVIDIA/nccl#964; 688 for groups of more than
    # two); the estimator adds it per group to its peak.
    comm_group_overhead_mb: float = 688.0
    # Refuse a run whose busiest rank would join more process groups than this (world included).
    max_comm_groups: int = 16
    activation_checkpointing: Checkpointing = Checkpointing.none
    # torch.compile every block's forward (sdp.parallel.compile); None: on CUDA, not on CPU.
    compile: bool | None = None
    compile_backend: CompileBackend = CompileBackend.inductor
    # bf16: compute in bf16 with fp32 master weights, gradients reduced in fp32.
    mixed_precision: Precision = Precision.fp32
    reshard_after_forward: bool = True  # fsdp: free gathered weights after each block's forward
    # fsdp with SDP masking: F, the ranks that shard each SDP worker's subnetwork
    # (K = world_size / F workers). Unused by plain FSDP, which shards over all ranks.
    fsdp_degree: int = 1
    # The process-group timeout: a collective that gets no reply for this long fails on every
    # rank still responding, with one error naming it. Long enough for the slowest legitimate
    # wait (a checkpoint of a large model, the first step's compilation on one rank).
    timeout_s: float = 1800.0


def sdp_workers(cfg: ParallelConfig, *, masking: str, world_size: int) -> int:
    """K, the number of SDP workers: the world, or world / F under SDP x FSDP."""
    sdp = masking in ("backward", "forward")
    return world_size // cfg.fsdp_degree if cfg.name == "fsdp" and sdp else world_size


# Communicators cost device memory (parallelism.comm_group_overhead_mb each): a rank in more
# than this many groups is a typo of parallelism.max_comm_groups, not a plan.
MAX_COMM_GROUPS = 4096


def validate_parallel(
    cfg: ParallelConfig,
    *,
    masking: str = "none",
    world_size: int = 1,
) -> None:
    if cfg.fsdp_degree < 1:
        raise ConfigError("parallelism.fsdp_degree", cfg.fsdp_degree, "must be >= 1")
    if cfg.fsdp_degree > 1 and not (cfg.name == "fsdp" and masking in ("backward", "forward")):
        raise ConfigError(
            "parallelism.fsdp_degree",
            cfg.fsdp_degree,
            f"is the shard group of each SDP worker and applies only to parallelism=fsdp with masking=forward "
            f"(here parallelism={cfg.name}, masking={masking}; plain FSDP shards over all ranks); allowed: 1",
        )
    if cfg.name == "fsdp" and masking in ("backward", "forward"):
        if masking != "forward":
            raise ConfigError(
                "parallelism",
                cfg.name,
                f"with masking={masking}: SDP x FSDP needs masking=forward (backward masking trains views "
                "into full weights on every rank, which FSDP's shards cannot host); allowed: parallelism=ddp",
            )
        if world_size % cfg.fsdp_degree:
            raise ConfigError(
                "parallelism.fsdp_degree",
                cfg.fsdp_degree,
                f"must divide the world size {world_size} (world = SDP workers x fsdp_degree)",
            )
    if cfg.bucket_cap_mb <= 0:
        raise ConfigError("parallelism.bucket_cap_mb", cfg.bucket_cap_mb, "must be > 0")
    if cfg.comm_group_overhead_mb < 0:
        raise ConfigError("parallelism.comm_group_overhead_mb", cfg.comm_group_overhead_mb, "must be >= 0")
    if not cfg.timeout_s > 0:
        raise ConfigError("parallelism.timeout_s", cfg.timeout_s, "must be > 0 (seconds)")
    if not 1 <= cfg.max_comm_groups <= MAX_COMM_GROUPS:
        raise ConfigError(
            "parallelism.max_comm_groups",
            cfg.max_comm_groups,
            f"must be in [1, {MAX_COMM_GROUPS}] (the world's group included; each is an NCCL communicator)",
        )


def move_to(model: nn.Module, device: torch.device) -> nn.Module:
    """Move `model` to `device` in place (Parameter objects are kept, so references to them
    stay valid); a no-op when it is there already, as the memory estimator's fake tensors are."""
    if any(t.device != device for t in [*model.parameters(), *model.buffers()]):
        model.to(device)
    return model


class Strategy:
    """What the training loop needs from a data-parallel scheme."""

    model: nn.Module  # run forward/backward on this
    # Autocast dtype of the forward (bf16 mixed precision without FSDP); None: fp32.
    autocast_dtype: torch.dtype | None = None
    # The model's forward computes the loss itself from `targets` (the LLaMA's; see
    # sdp.models.llama.LlamaLM); set by whoever builds the strategy from the model config.
    loss_in_model: bool = False
    # Every block's forward is compiled (parallelism.compile); set by whoever builds the strategy.
    compiled: bool = False

    def autocast(self):
        """Context for the forward pass: bf16 autocast with fp32 weights, or nothing."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(next(self.model.parameters()).device.type, dtype=self.autocast_dtype)

    def trainable(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def no_sync(self):
        """Context for micro-batches before the last one of a step (no gradient sync)."""
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        """Called once per step after the last micro-batch's backward."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        raise NotImplementedError

    def after_step(self) -> None:
        """Called after every optimizer step."""

    def portable_state(self, optimizer: torch.optim.Optimizer) -> PortableState:
        """Collective: the trained state in plain coordinates, on the host of every rank."""
        raise NotImplementedError

    def load_portable_state(self, optimizer: torch.optim.Optimizer, state: PortableState) -> None:
        """Collective: make `state` this rank's, cut into its pieces (a resume, on any world size)."""
        raise NotImplementedError

    def settle(self) -> None:
        """Finish communication still in flight that the model's values depend on (backward
        masking's overlapped weight refresh): before they are read from outside a forward."""

    def comm_groups(self) -> int:
        """Process groups (with NCCL: communicators) this rank is a member of, the world included."""
        return 1

    def forward_params(self) -> int:
        """Parameters this rank's forward computes with (all of them, but under forward masking)."""
        return self.full_params

    def resample(self, step: int, optimizer: torch.optim.Optimizer) -> bool:
        """Called after optimizer step `step` (not the last): a strategy that changes which
        tensors this rank trains rebuilds `model` and re-points `optimizer`, and returns True."""
        return False

    @contextlib.contextmanager
    def eval_model(self):
        """The full plain model, current on every rank, in eval mode."""
        raise NotImplementedError
        yield

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the plain model by its plain name, current on every rank (collective)."""
        raise NotImplementedError

    def plain_state_dict(self, eval_model: nn.Module) -> dict[str, torch.Tensor]:
        """The state dict of `eval_model` (from `eval_model()`) under the plain model's names:
        it loads into the plain model with `load_state_dict(..., strict=True)`."""
        return eval_model.state_dict()

    def memory(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        raise NotImplementedError

    def describe(self) -> dict:
        """Extra entries for summary.json."""
        return {}


def _counting_allreduce_hook(counter, bucket):
    """DDP's default mean all-reduce, with the bucket's bytes counted as gradient sync.

    Unannotated on purpose: DDP compares the annotations with real types, and
    this module's postponed annotations would be strings.
    """
    buffer = bucket.buffer()
    counter.add("grad_sync", buffer.numel() * buffer.element_size())
    buffer.div_(dist.get_world_size())
    fut = dist.all_reduce(buffer, async_op=True).get_future()
    return fut.then(lambda _: buffer)  # all_reduce is in place


class DDPStrategy(Strategy):
    """torch DistributedDataParallel over all ranks: every rank holds and trains everything."""

    def __init__(self, model: nn.Module, cfg: ParallelConfig, *, device: torch.device, comm: CommCounter):
        self.autocast_dtype = torch.bfloat16 if cfg.mixed_precision == "bf16" else None
        self.plain = model
        self.full_params = sum(p.numel() for p in model.parameters())
        self.shared_params = self.full_params  # every parameter is held and averaged by every rank
        self.model = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=cfg.bucket_cap_mb,
            # Gradients live in the all-reduce buckets: one copy of them, not two.
            gradient_as_bucket_view=True,
        )
        self.model.register_comm_hook(comm, _counting_allreduce_hook)
        # Exposed communication: from the last gradient the backward makes to the end of
        # backward(), where DDP's reducer waits for its last buckets.
        self.comm, self._last_grad = comm, None
        # Gradients made so far in this step, and in the step before: the last one is marked
        # (one CUDA event a step, not one per parameter).
        self._made, self._expected = 0, 0
        # The step-time model's record of the reducer's buckets: [index, bytes] of the one filling.
        self._cap, self._bucket = int(cfg.bucket_cap_mb * 2**20), [0, 0]
        comm.track_waits()
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_made)

    def _grad_made(self, p) -> None:
        self._made += 1
        if self._made >= self._expected:
            self._last_grad = self.comm.start()
        if self.comm.timeline is not None:  # the estimator's record of the reducer's buckets
            self._bucket[1] += p.numel() * p.element_size()
            if self._bucket[1] >= self._cap:
                self._close_bucket()

    def _close_bucket(self) -> None:
        """A bucket of DDP's: after its first step the reducer buckets gradients in the order they
        arrive, bucket_cap_mb each (the first too: DDP keeps a 1 MiB first bucket only when no cap
        is given, and this strategy always gives one), and all-reduces each when full. (The
        estimator cannot let the reducer rebuild: that reads tensor data.)"""
        if self._bucket[1]:
            self.comm.event("all_reduce", "grad_sync", self._bucket[1], tuple(range(dist.get_world_size())))
        self._bucket = [self._bucket[0] + 1, 0]

    def after_backward(self) -> None:
        self._made, self._expected = 0, self._made
        if self.comm.timeline is not None:
            self._close_bucket()
            self._bucket = [0, 0]
            self.comm.need_pending(("grad_sync",))  # the reducer waited for its buckets in backward()
        if self._last_grad is not None:
            self.comm.stop(self._last_grad)
            self._last_grad = None

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.plain.parameters() if p.requires_grad]

    def no_sync(self):
        return self.model.no_sync()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.plain.parameters(), max_norm)

    @contextlib.contextmanager
    def eval_model(self):
        # After the last step each rank's BatchNorm statistics carry its own last
        # batch; use rank 0's, as DDP's next forward would.
        for buf in self.plain.buffers():
            dist.broadcast(buf, src=0)
        was_training = self.plain.training
        self.plain.eval()
        try:
            yield self.plain
        finally:
            self.plain.train(was_training)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.plain.named_parameters())

    def portable_state(self, optimizer: torch.optim.Optimizer) -> PortableState:
        # Every rank holds the same state but its own BatchNorm statistics: rank 0's are kept,
        # the ones evaluation uses.
        optim, scalars = state_by_name(optimizer, dict(self.plain.named_parameters()), convert=host)
        return PortableState(rank0_buffers(self.plain), optim, scalars, hyperparameters(optimizer))

    def load_portable_state(self, optimizer: torch.optim.Optimizer, state: PortableState) -> None:
        with torch.no_grad():
            self.plain.load_state_dict(state.model)
        params = dict(self.plain.named_parameters())
        set_state(optimizer, state.per_parameter(params), state.groups)

    def memory(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        return static_bytes(self.plain.parameters(), optimizer)

    def describe(self) -> dict:
        return {"shared_params": self.shared_params}
