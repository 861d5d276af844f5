"""parallelism.*: the data-parallel scheme's config and the checks on its values alone."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from sdp.errors import ConfigError


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


# parallelism.timeout_s: every rank must reach the rendezvous within it (importing torch takes
# seconds; 0.001 s let the rank die in DistNetworkError here). At 1e10 s, past torch's int64
# nanoseconds, the rendezvous timed out at once; the bound is the smaller limit of a C int of
# milliseconds (2**31 - 1 ms, 24.8 days, what poll(2)-style waits take). Measured here: 3e6 s
# still ran on one rank, so the exact layer that fails first in between is not known.
TIMEOUT_RANGE_S = (10, (2**31 - 1) // 1000)

# Communicators cost device memory (parallelism.comm_group_overhead_mb each): a rank in more
# than this many groups is a typo of parallelism.max_comm_groups, not a plan.
MAX_COMM_GROUPS = 4096


MAX_BYTES = 2**63 - 1  # what a 64-bit integer holds: torch and the estimator count bytes in them


def mib_fits(key: str, mib: float) -> None:
    """Refuse a size in MiB whose bytes a 64-bit integer does not hold."""
    if int(mib * 2**20) > MAX_BYTES:
        limit = MAX_BYTES / 2**20
        raise ConfigError(key, mib, f"must be at most {limit:.4g} MiB: its bytes must fit a 64-bit integer")


def validate_parallel(cfg: ParallelConfig) -> None:
    """The checks on parallelism.* alone. Those that depend on the masking (SDP x FSDP's
    fsdp_degree) are SDP's: `sdp.subnet.validate_sdp_x_fsdp`."""
    if cfg.fsdp_degree < 1:
        raise ConfigError("parallelism.fsdp_degree", cfg.fsdp_degree, "must be >= 1")
    if cfg.bucket_cap_mb <= 0:
        raise ConfigError("parallelism.bucket_cap_mb", cfg.bucket_cap_mb, "must be > 0")
    if cfg.comm_group_overhead_mb < 0:
        raise ConfigError("parallelism.comm_group_overhead_mb", cfg.comm_group_overhead_mb, "must be >= 0")
    for key in ("bucket_cap_mb", "comm_group_overhead_mb"):
        mib_fits(f"parallelism.{key}", getattr(cfg, key))
    if not TIMEOUT_RANGE_S[0] <= cfg.timeout_s <= TIMEOUT_RANGE_S[1]:
        raise ConfigError(
            "parallelism.timeout_s",
            cfg.timeout_s,
            f"must be in [{TIMEOUT_RANGE_S[0]:.0f}, {TIMEOUT_RANGE_S[1]:.0f}] seconds: shorter, ranks that start "
            "seconds apart cannot meet; longer, its milliseconds overflow a C int (24.8 days)",
        )
    if not 1 <= cfg.max_comm_groups <= MAX_COMM_GROUPS:
        raise ConfigError(
            "parallelism.max_comm_groups",
            cfg.max_comm_groups,
            f"must be in [1, {MAX_COMM_GROUPS}] (the world's group included; each is an NCCL communicator)",
        )
