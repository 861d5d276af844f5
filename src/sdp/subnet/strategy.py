"""SDP as a data-parallel strategy for the training loop: `SDPStrategy`, a facade over its parts.

The parts, each with one job: the plan (`plan.SubnetPlan`: units, mask, holder sets, the
checks before launch), the installer (`install.Installer`: masking applied, groups registered),
the step's communication (`step.StepSync`: gradient averaging, with backward masking's weight
refresh, `refresh.Refresh`), assembly of the plain model (`assembly.Assembler`) and the state
mover that resampling and checkpoints share (`state.StateMover`). SDP x FSDP
(`sdp.subnet.sharded`) supplies its own installer, state mover and gradient scaling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from sdp.metrics.comm import CommCounter
from sdp.metrics.memory import static_bytes
from sdp.optim import set_state
from sdp.parallel import PortableState, Strategy
from sdp.subnet import MaskingConfig, resolved_scale
from sdp.subnet.assembly import Assembler
from sdp.subnet.install import Installed, Installer
from sdp.subnet.mask import Mask
from sdp.subnet.modes import mode_of
from sdp.subnet.plan import SubnetPlan
from sdp.subnet.refresh import Refresh
from sdp.subnet.state import StateMover
from sdp.subnet.step import StepSync, scale_grads


class SDPStrategy(Strategy):
    """Each rank trains its subnetwork; gradients are averaged among each unit's holders.

    Why 21 methods: 17 are the `Strategy` interface the trainer calls and `__init__`, each a
    delegation of a line or a few to a part; the others keep the parts on the current
    subnetwork (`_install`), make the two parts SDP x FSDP replaces (`_installer`, `_mover`)
    and record the collectives for the tests (`trace_collectives`).
    """

    fsdp_degree = 1  # F, the ranks of a worker (SDP x FSDP's are more)
    scale_grads = staticmethod(scale_grads)  # clipping's scaling of the trained gradients

    def __init__(
        self,
        model: nn.Module,
        cfg: MaskingConfig,
        *,
        family: str,
        rank: int,
        world_size: int,
        device: torch.device,
        comm: CommCounter,
        bucket_cap_mb: float,
        make_plain: Callable[[], nn.Module],
        prepare: Callable[[nn.Module], object] | None = None,
        autocast_dtype: torch.dtype | None = None,
        epoch: int = 0,
        overlap: bool = True,
        compiled: bool = False,
        plan: SubnetPlan | None = None,
        local_steps: bool = False,
    ):
        """`model` is the full plain model on the host, initialised alike on every rank;
        `world_size` is K, the SDP workers; `make_plain` builds a full plain model on `device`,
        which assembly overwrites; `prepare` is applied to every subnetwork this rank trains
        (activation checkpointing); `epoch` is the mask epoch to start in (a resumed run's);
        `overlap` (parallelism.overlap_comm) overlaps gradient averaging with the backward and
        backward masking's weight refresh with the next forward; `compiled`: `prepare` compiles
        every block's forward (parallelism.compile), so the refresh waits before each block.
        `plan`: the plan of this model, config and K (`validate_plan`'s), else made here.
        `local_steps`: each rank steps alone, its gradients and weights unshared between the
        syncs of an outer loop (`sdp.outer`)."""
        plan = plan or SubnetPlan.build(model, cfg, family=family, workers=world_size, fsdp_degree=self.fsdp_degree)
        _check_plan(plan, cfg, family=family, workers=world_size, fsdp_degree=self.fsdp_degree)
        self.plan, self.cfg, self.rank, self.device, self.comm = plan, cfg, rank, device, comm
        self.autocast_dtype, self.compiled, self.epoch = autocast_dtype, compiled, epoch
        self.spec, self.shapes, self.worker = plan.spec, plan.shapes, plan.worker_of(rank)
        self.full_params = plan.full_params
        comm.track_waits()
        self.installer = self._installer(prepare)
        self.installer.register([tuple(range(world_size))])
        self.assembly = Assembler(
            plan, rank=rank, comm=comm, bucket_cap_mb=bucket_cap_mb, device=device, make_plain=make_plain
        )
        self.mover = self._mover(bucket_cap_mb)
        refresh = Refresh(
            rank=rank, comm=comm, bucket_cap_mb=bucket_cap_mb, device=device, position=plan.position, overlap=overlap
        )
        self.step_sync = StepSync(
            groups=self.installer.groups,
            comm=comm,
            bucket_cap_mb=bucket_cap_mb,
            position=plan.position,
            block=plan.block_of,
            rank=rank,
            overlap=overlap,
            refresh=refresh,
            scale=self.scale_grads,
            local=local_steps,
        )
        self._install(model, plan.mask_at(epoch))

    # The parts SDP x FSDP (sdp.subnet.sharded) supplies its own of.

    def _installer(self, prepare) -> Installer:
        return Installer(self.plan, rank=self.rank, device=self.device, prepare=prepare)

    def _mover(self, bucket_cap_mb: float) -> StateMover:
        return StateMover(
            self.assembly, rank=self.rank, comm=self.comm, bucket_cap_mb=bucket_cap_mb, device=self.device
        )

    def _install(self, model: nn.Module, mask: Mask) -> None:
        """Make `model` (a full plain model, current weights) this rank's subnetwork under `mask`,
        and point every part at it."""
        self.installed: Installed = self.installer.install(model, mask)
        self.step_sync.rebuild(self.installed, wait_at=self.plan.enclosing_block if self.compiled else None)
        # What outside readers (the trainer, the tests) look at: the current ones.
        self.mask, self.subnet, self.chunks = mask, self.installed.subnet, self.installed.chunks
        self.model, self.sync = self.installed.model, self.step_sync.grads

    def trace_collectives(self, trace: list | None) -> None:
        """Record every gradient all-reduce and weight-refresh broadcast this rank issues, in
        issue order, into `trace` (None: stop), as (holder set or "world", kind, bucket)."""
        self.step_sync.trace_collectives(trace)

    def resample(self, step: int, optimizer: torch.optim.Optimizer) -> bool:
        """After optimizer step `step`, every masking.resample_every steps: draw the next mask,
        move units' weights and optimizer state to their new holders, rebuild the subnetwork
        and point `optimizer` at it (collective). Returns whether the mask changed."""
        every = self.cfg.resample_every
        if not every or step % every:
            return False
        self.settle()
        state, scalars = self.mover.gather(self.installed, optimizer, comm=self.comm)
        full = self.assembly.current_plain_model(self.installed)
        self.epoch = step // every
        self._install(full, self.plan.mask_at(self.epoch))
        self.mover.place(self.installed, optimizer, state, scalars)
        return True

    def portable_state(self, optimizer: torch.optim.Optimizer) -> PortableState:
        self.settle()
        return self.mover.portable_state(self.installed, optimizer)

    @torch.no_grad()
    def load_portable_state(self, optimizer: torch.optim.Optimizer, state: PortableState) -> None:
        # The second half of a resample: this rank's subnetwork under the current mask (the
        # resumed step's mask epoch, for this world size), cut from the full model and state.
        self._install(self.mover.plain_model(state), self.mask)
        self.mover.place(self.installed, optimizer, state.optim, state.scalars)
        set_state(optimizer, dict(optimizer.state), state.groups)

    def trainable(self) -> list[nn.Parameter]:
        return self.subnet.trainable

    def no_sync(self):
        return self.step_sync.no_sync()

    def after_backward(self) -> None:
        self.step_sync.after_backward()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return self.step_sync.clip_grad_norm_(max_norm)

    def after_step(self) -> None:
        self.step_sync.after_step()

    def settle(self) -> None:
        self.step_sync.settle()

    def comm_groups(self) -> int:
        return 1 + self.installer.groups.joined(self.rank)

    def forward_params(self) -> int:
        return mode_of(self.cfg.name).forward_params(self)

    @contextlib.contextmanager
    def eval_model(self):
        self.settle()
        model = self.assembly.eval_model(self.installed)
        was_training = model.training
        model.eval()
        try:
            yield model
        finally:
            model.train(was_training)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the plain model by its plain name, current on every rank (collective)."""
        self.settle()
        return self.assembly.full_parameters(self.installed)

    def plain_state_dict(self, eval_model: nn.Module) -> dict[str, torch.Tensor]:
        self.settle()
        return self.assembly.plain_state_dict(self.installed, eval_model)

    def memory(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        return static_bytes([*self.model.parameters(), *self.subnet.weight_tensors], optimizer)

    def describe(self) -> dict:
        return {
            "granularity": self.cfg.granularity,
            "construction": self.cfg.construction,
            "scale": resolved_scale(self.cfg),
            "resample_every": self.cfg.resample_every,
            "mask": self.plan.stats,
            "shared_params": self.plan.shared_params,
        }


def _check_plan(plan: SubnetPlan, cfg: MaskingConfig, *, family: str, workers: int, fsdp_degree: int) -> None:
    """A plan handed to a strategy must be the plan of its config, family, K and F."""
    got = (plan.cfg, plan.family, plan.workers, plan.fsdp_degree)
    if got != (cfg, family, workers, fsdp_degree):
        raise ValueError(
            f"the plan (masking, family, workers, fsdp_degree) = {got} is not this strategy's "
            f"{(cfg, family, workers, fsdp_degree)}"
        )
