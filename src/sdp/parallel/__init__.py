"""Data parallelism applied from outside the model (DDP for now)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sdp.errors import ConfigError
from sdp.metrics.comm import CommCounter

PARALLELISMS = ("ddp",)


@dataclass
class ParallelConfig:
    name: str = "ddp"
    backend: str = "auto"  # auto | gloo | nccl
    bucket_cap_mb: int = 25


def validate_parallel(cfg: ParallelConfig) -> None:
    if cfg.name not in PARALLELISMS:
        raise ConfigError("parallelism.name", cfg.name, f"allowed: {', '.join(PARALLELISMS)}")
    if cfg.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError("parallelism.backend", cfg.backend, "allowed: auto, gloo, nccl")
    if cfg.bucket_cap_mb <= 0:
        raise ConfigError("parallelism.bucket_cap_mb", cfg.bucket_cap_mb, "must be > 0")


def _counting_allreduce_hook(counter, bucket):
    """DDP's default mean all-reduce, with the bucket's bytes counted as gradient sync.

    Unannotated on purpose: DDP compares the annotations with real types, and
    this module's postponed annotations would be strings.
    """
    buffer = bucket.buffer()
    counter.add("grad_sync", buffer.numel() * buffer.element_size())
    buffer.div_(dist.get_world_size())
    fut = dist.all_reduce(buffer, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def apply_parallelism(model: nn.Module, cfg: ParallelConfig, *, device: torch.device, comm: CommCounter) -> nn.Module:
    """Wrap the plain model for data-parallel training; its gradients are counted into `comm`."""
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
    )
    ddp.register_comm_hook(comm, _counting_allreduce_hook)
    return ddp


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside any wrapper."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def broadcast_buffers(model: nn.Module, *, src: int = 0) -> None:
    """Make buffers (BatchNorm running stats) equal to rank `src`'s, as DDP does before each forward.

    After the last training step each rank's buffers carry its own last batch;
    evaluation and checkpoints use rank 0's, like the next DDP forward would.
    """
    for buf in unwrap(model).buffers():
        dist.broadcast(buf, src=src)
