"""DiLoCo (arXiv 2311.08105), with Streaming DiLoCo's fragments (arXiv 2501.18512): each worker
steps alone for H steps, then the holders average each piece's pseudo-gradient (one all-reduce per
bucket) and an outer Nesterov SGD step moves theta_prev (`sdp.outer.loop`'s sync):

    Delta_  = each piece's Delta averaged over the piece's holders
    m       = momentum * m + Delta_
    u       = Delta_ + momentum * m                 (Nesterov, as torch.optim.SGD)

The momentum is the same on every holder of a piece: it is checkpointed in plain coordinates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.distributed as dist
from torch import nn

from sdp.errors import ConfigError
from sdp.outer.algorithms import OuterAlgorithm, OuterConfig, check_window, register
from sdp.outer.loop import OuterLoop, OuterMethod, pack, unpack


class CommDtype(StrEnum):
    """outer.comm_dtype: the pseudo-gradients' dtype on the wire."""

    fp32 = "fp32"
    bf16 = "bf16"


WIRE = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class DiLoCoConfig(OuterConfig):
    lr: float = 0.7  # the outer Nesterov SGD's learning rate (DiLoCo's)
    momentum: float = 0.9  # its momentum, in [0, 1) (DiLoCo's; 0: plain SGD)
    comm_dtype: CommDtype = CommDtype.fp32


class DiLoCoMethod(OuterMethod):
    """The holders' mean of the pseudo-gradients, and the outer Nesterov momentum."""

    def __init__(self, loop: OuterLoop):
        super().__init__(loop)
        self.wire = WIRE[str(self.cfg.comm_dtype)]
        self.momentum: dict[nn.Parameter, torch.Tensor] = {}

    def exchange(self, fragment: int, delta: dict[nn.Parameter, torch.Tensor]) -> None:
        """Each multi-holder piece of `delta` replaced by its mean over the piece's holders: every
        bucket's all-reduce issued (in `comm_dtype`), then each waited for and unpacked."""
        loop, issued = self.loop, []
        for b in loop.buckets[fragment]:
            flat = pack(b, lambda p: delta[p], dtype=self.wire)
            event = loop.issued(
                "all_reduce", flat.numel() * flat.element_size(), b.holders, fragment=fragment, index=b.index
            )
            work = dist.all_reduce(flat, group=loop.view.group(b.holders), async_op=True)
            issued.append((b, flat, work, event))
        with loop.comm.waiting():
            for b, flat, work, event in issued:
                work.wait()
                loop.comm.need(event)
                unpack(flat.float().div_(len(b.holders)), b, lambda p: delta[p])

    def direction(self, p: nn.Parameter, d: torch.Tensor) -> torch.Tensor:
        mu = self.cfg.momentum
        if mu == 0:
            return d
        # With backup_device=device `m` is the momentum itself (no copy), updated in place.
        m = self.momentum[p].to(d.device).mul_(mu).add_(d)
        if m is not self.momentum[p]:  # backup_device=cpu on an accelerator: back to the host
            self.momentum[p].copy_(m)
        return d.add(m, alpha=mu)

    def state(self) -> dict[str, dict[nn.Parameter, torch.Tensor]]:
        return {"momentum": self.momentum} if self.momentum else {}

    def load_state(self, placed: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        if self.cfg.momentum == 0:
            return
        home = self.loop.home
        self.momentum = {
            p: placed[p]["momentum"].to(home) if "momentum" in placed[p] else torch.zeros_like(self.loop.backup[p])
            for p in self.loop.view.trainable
        }

    def state_bytes(self) -> dict[str, int]:
        return {"outer_momentum_bytes": sum(t.numel() * t.element_size() for t in self.momentum.values())}

    def state_tensors(self) -> list[torch.Tensor]:
        return list(self.momentum.values())

    def knobs(self) -> dict:
        return {"lr": self.cfg.lr, "momentum": self.cfg.momentum, "comm_dtype": str(self.cfg.comm_dtype)}


class DiLoCo(OuterAlgorithm):
    """DiLoCo's knobs and checks; its loop: `DiLoCoMethod` over `OuterLoop`."""

    name, title, schema = "diloco", "DiLoCo", DiLoCoConfig
    caveat = "outer loop: trailed DDP at equal steps"

    def validate(self, cfg) -> None:
        check_window(cfg)
        if not (math.isfinite(cfg.lr) and cfg.lr > 0):
            raise ConfigError("outer.lr", cfg.lr, "must be a finite number > 0 (DiLoCo's: 0.7)")
        if not (math.isfinite(cfg.momentum) and 0 <= cfg.momentum < 1):
            raise ConfigError("outer.momentum", cfg.momentum, "must be in [0, 1) (DiLoCo's: 0.9; 0: no momentum)")

    def build(self, cfg, view, *, device, comm, max_steps: int, bucket_cap_mb: float) -> OuterLoop:
        return OuterLoop(
            cfg, view, device=device, comm=comm, max_steps=max_steps, bucket_cap_mb=bucket_cap_mb, method=DiLoCoMethod
        )


register(DiLoCo())
