"""SDP as a data-parallel strategy for the training loop."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from sdp.metrics.comm import CommCounter
from sdp.metrics.memory import static_bytes
from sdp.optim import hyperparameters, rebind, set_state
from sdp.parallel import PortableState, Strategy, host, move_to
from sdp.subnet import MaskingConfig, resolved_scale
from sdp.subnet.apply import (
    apply_backward_masking,
    apply_forward_masking,
    backward_buffer_sync,
    fold_eval_scaling,
    forward_assembly,
    named_tensors,
)
from sdp.subnet.groups import HolderGroups
from sdp.subnet.plan import SubnetPlan, mask_of, plan_mask, planned_comm_groups, validate_plan
from sdp.subnet.refresh import WeightRefresh
from sdp.subnet.resample import gather_state, place_state
from sdp.subnet.sync import GradSync, Transfer, broadcast_from_holders

# The plan's functions live in sdp.subnet.plan; they stay importable from here.
__all__ = ["SDPStrategy", "SubnetPlan", "mask_of", "plan_mask", "planned_comm_groups", "validate_plan"]


class SDPStrategy(Strategy):
    """Each rank trains its subnetwork; gradients are averaged among each unit's holders."""

    fsdp_degree = 1  # F, the ranks of a worker (SDP x FSDP's are more)

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
    ):
        """`model` is the full plain model on the host, initialised alike on every rank;
        `make_plain` builds a full plain model on `device`, which assembly overwrites;
        `prepare` is applied to every subnetwork this rank trains (activation checkpointing);
        `epoch` is the mask epoch to start in (a resumed run's); `overlap`
        (parallelism.overlap_comm) overlaps gradient averaging with the backward and
        backward masking's weight refresh with the next forward; `compiled`: `prepare` compiles
        every block's forward (parallelism.compile), so the refresh waits before each block.
        `plan`: the plan of this model, config and K workers (`validate_plan`'s), else made here."""
        plan = plan or SubnetPlan.build(model, cfg, family=family, workers=world_size, fsdp_degree=self.fsdp_degree)
        _check_plan(plan, cfg, family=family, workers=world_size, fsdp_degree=self.fsdp_degree)
        self.plan = plan
        self.cfg, self.rank, self.world_size, self.device, self.comm = cfg, rank, world_size, device, comm
        self.bucket_cap_mb, self.make_plain, self.prepare = bucket_cap_mb, make_plain, prepare
        self.autocast_dtype = autocast_dtype
        self.spec, self.shapes, self.stats = plan.spec, plan.shapes, plan.stats
        self.epoch = epoch
        self.mask = plan.mask_at(epoch)
        self.full_params, self.shared_params = plan.full_params, plan.shared_params
        self.plain_names = list(self.shapes)
        self.position, self.block_of = plan.position, plan.block_of
        self.overlap, self.sync, self.refresh, self._trace = overlap, None, None, None
        self.compiled = compiled
        comm.track_waits()
        self.groups = HolderGroups([], world_size=torch.distributed.get_world_size())
        self._register_groups([tuple(range(world_size))])
        self._install(model)

    def _install(self, model: nn.Module) -> None:
        """Make `model` (a full plain model, current weights) this rank's subnetwork under self.mask."""
        if self.cfg.name == "forward":
            # Slice where the full model is, then move only the submodel: when it is on the
            # host, the device never holds the full model.
            self.subnet, self.chunks = apply_forward_masking(
                model, self.spec, self.mask, rank=self.worker, scale=resolved_scale(self.cfg)
            )
            move_to(self.subnet.model, self.device)
        else:
            # Pieces view the full weights: they must be made where the weights live.
            self.subnet, self.chunks = apply_backward_masking(
                move_to(model, self.device), self.spec, self.mask, rank=self.worker
            )
        self.model = self.subnet.model
        if self.prepare is not None:
            self.prepare(self.model)
        self._register_groups(self.mask.holder_sets())
        for old in (self.sync, self.refresh):  # the last subnetwork's, after a resample
            if old is not None:
                old.remove_hooks()
        self.sync = GradSync(
            self._finish_subnet(),
            groups=self.groups,
            comm=self.comm,
            bucket_cap_mb=self.bucket_cap_mb,
            position=self.position,
            block=self.block_of,
            overlap=self.overlap,
        )
        self.refresh = None
        if self.overlap and self.subnet.refresh:
            self.refresh = WeightRefresh(
                self.subnet.refresh,
                model=self.model,
                position=self.position,
                rank=self.rank,
                comm=self.comm,
                bucket_cap_mb=self.bucket_cap_mb,
                device=self.device,
                wait_at=self.plan.enclosing_block if self.compiled else None,
            )
        self.trace_collectives(self._trace)

    def trace_collectives(self, trace: list | None) -> None:
        """Record every gradient all-reduce and weight-refresh broadcast this rank issues, in
        issue order, into `trace` (None: stop), as (holder set or "world", kind, bucket)."""
        self._trace = trace
        self.sync.trace = trace
        if self.refresh is not None:
            self.refresh.trace = trace

    # Hooks for SDP x FSDP (sdp.subnet.sharded), where a worker is a group of ranks.

    @property
    def worker(self) -> int:
        """This rank's SDP worker (its index in the mask)."""
        return self.rank

    def _register_groups(self, holder_sets) -> None:
        """Process groups for holder sets of workers (collective: every rank, same sets)."""
        self.groups.add(holder_sets)

    def _finish_subnet(self) -> list:
        """Last touches to a new subnetwork; returns its gradient entries (holders as ranks)."""
        return self.subnet.grad_entries

    def _local_tensors(self) -> dict[str, torch.Tensor]:
        """This worker's submodel tensors by name, unsharded."""
        return named_tensors(self.model)

    def _rank_space(self, transfers: list[Transfer]) -> list[Transfer]:
        """Transfers whose sources are workers, with ranks as sources."""
        return transfers

    def resample(self, step: int, optimizer: torch.optim.Optimizer) -> bool:
        """After optimizer step `step`, every masking.resample_every steps: draw the next mask,
        move units' weights and optimizer state to their new holders, rebuild the subnetwork
        and point `optimizer` at it (collective). Returns whether the mask changed."""
        every = self.cfg.resample_every
        if not every or step % every:
            return False
        self.settle()
        state, scalars = self._gather_state(optimizer, comm=self.comm)
        full = self._current_plain_model()
        self.epoch = step // every
        self.mask = self.plan.mask_at(self.epoch)
        self._install(full)
        self._set_state(optimizer, state, scalars)
        return True

    def _gather_state(self, optimizer: torch.optim.Optimizer, *, comm: CommCounter | None):
        """Collective: every trained tensor's optimizer state in plain coordinates, on the host
        of every rank (bytes counted as resample traffic in `comm`, when given)."""
        return gather_state(
            self._optimizer_view(optimizer),
            self.subnet.grad_entries,
            self.chunks,
            shapes=self.shapes,
            rank=self.rank,
            comm=comm,
            bucket_cap_mb=self.bucket_cap_mb,
            device=self.device,
            worker=self.worker,
            rank_space=self._rank_space,
        )

    def portable_state(self, optimizer: torch.optim.Optimizer) -> PortableState:
        # What a resample gathers (the units' state from their holders, the full model), not
        # counted as traffic of the training steps.
        self.settle()
        optim, scalars = self._gather_state(optimizer, comm=None)
        model = {n: host(t) for n, t in self._current_plain_model(counted=False).state_dict().items()}
        return PortableState(model, optim, scalars, hyperparameters(optimizer))

    @torch.no_grad()
    def load_portable_state(self, optimizer: torch.optim.Optimizer, state: PortableState) -> None:
        # The second half of a resample: this rank's subnetwork under the current mask (the
        # resumed step's mask epoch, for this world size), cut from the full model and state.
        full = self._fresh_plain()
        full.load_state_dict(state.model)
        self._install(full)
        self._set_state(optimizer, state.optim, state.scalars)
        set_state(optimizer, dict(optimizer.state), state.groups)

    def _optimizer_view(self, optimizer: torch.optim.Optimizer):
        """The optimizer as `gather_state` reads it: state keyed by the tensors of subnet.grad_entries."""
        return optimizer

    def _set_state(self, optimizer: torch.optim.Optimizer, state: dict, scalars: dict) -> None:
        """Point `optimizer` at the new subnetwork, with its state cut from the gathered full state."""
        rebind(
            optimizer, self.subnet.trainable, place_state(state, scalars, self.subnet.grad_entries, self.trainable())
        )

    @torch.no_grad()
    def _current_plain_model(self, *, counted: bool = True) -> nn.Module:
        """A plain model with the current weights and buffers, on every rank (collective); the
        bytes sent are counted as resample traffic when `counted`."""
        if self.cfg.name == "forward":
            return self.assemble(fold_eval_scale=False, comm_kind="resample" if counted else None)
        broadcast_from_holders(
            backward_buffer_sync(self.model, self.spec, self.chunks, rank=self.rank),
            rank=self.rank,
            comm=self.comm if counted else None,
            kind="resample",
            bucket_cap_mb=self.bucket_cap_mb,
            device=self.device,
        )
        full = self._fresh_plain()
        params = self.full_parameters()  # current everywhere: the weight refresh ran after the step
        for name, p in full.named_parameters():
            p.copy_(params[name])
        buffers = dict(self.model.named_buffers())
        for name, b in full.named_buffers():
            b.copy_(buffers[name])
        return full

    def _fresh_plain(self) -> nn.Module:
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            return self.make_plain()  # its random init must not move the training RNG streams

    def trainable(self) -> list[nn.Parameter]:
        return self.subnet.trainable

    @contextlib.contextmanager
    def no_sync(self):
        self.sync.active = False  # gradients accumulate; the hooks launch nothing
        try:
            yield
        finally:
            self.sync.active = True

    def after_backward(self) -> None:
        self.comm.need_pending(("grad_reduce_scatter",))  # SDP x FSDP: FSDP's, waited for in backward()
        if self.refresh is not None:
            self.refresh.wait_all()  # the forward waited for every piece it read; nothing is left
        with self.comm.waiting():
            self.sync()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        norm = self.sync.global_norm(rank=self.rank)
        torch.nn.utils.clip_grads_with_norm_(self.subnet.trainable, max_norm, norm.float())
        return norm

    def after_step(self) -> None:
        if self.refresh is not None:
            self.refresh.start()  # the next forward waits for each module's pieces
        elif self.subnet.refresh:
            with self.comm.waiting():
                broadcast_from_holders(
                    self.subnet.refresh,
                    rank=self.rank,
                    comm=self.comm,
                    kind="weight_refresh",
                    bucket_cap_mb=self.bucket_cap_mb,
                    device=self.device,
                )

    def settle(self) -> None:
        if self.refresh is not None:
            self.refresh.wait_all()

    def comm_groups(self) -> int:
        return 1 + self.groups.joined(self.rank)

    def forward_params(self) -> int:
        if self.cfg.name == "backward":  # the full model's forward, on every rank
            return self.full_params
        return sum(p.numel() for p in self.model.parameters())  # the smaller subnetwork (DTensors: unsharded)

    @contextlib.contextmanager
    def eval_model(self):
        self.settle()
        if self.cfg.name == "backward":
            transfers = backward_buffer_sync(self.model, self.spec, self.chunks, rank=self.rank)
            broadcast_from_holders(
                transfers, rank=self.rank, comm=None, kind="eval", bucket_cap_mb=self.bucket_cap_mb, device=self.device
            )
            model = self.model
        else:
            model = self.assemble(fold_eval_scale=True)
        was_training = model.training
        model.eval()
        try:
            yield model
        finally:
            model.train(was_training)

    @torch.no_grad()
    def assemble(self, *, fold_eval_scale: bool, comm_kind: str | None = None) -> nn.Module:
        """The full plain model, gathered from the holders (forward masking); with
        `fold_eval_scale`, as evaluated (masking.scale=eval_coverage folded into its weights).
        With `comm_kind`, the bytes sent are counted under that kind."""
        full = self._fresh_plain()
        local = self._local_tensors()
        for name in self.spec.shared_params:
            full.get_parameter(name).copy_(local[name])
        transfers = self._rank_space(forward_assembly(local, full, self.spec, self.chunks, rank=self.worker))
        broadcast_from_holders(
            transfers,
            rank=self.rank,
            comm=self.comm if comm_kind else None,
            kind=comm_kind or "assembly",
            bucket_cap_mb=self.bucket_cap_mb,
            device=self.device,
        )
        if fold_eval_scale and resolved_scale(self.cfg) == "eval_coverage":
            fold_eval_scaling(full, self.spec, self.mask.holders / self.mask.num_workers)
        return full

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the plain model by its plain name, current on every rank (collective)."""
        self.settle()
        if self.cfg.name == "forward":
            return dict(self.assemble(fold_eval_scale=False).named_parameters())
        out = {}
        for name in self.plain_names:
            owner_path, _, attr = name.rpartition(".")
            owner = self.model.get_submodule(owner_path) if owner_path else self.model
            out[name] = owner._buffers.get(f"{attr}_full", getattr(owner, attr))
        return out

    def plain_state_dict(self, eval_model: nn.Module) -> dict[str, torch.Tensor]:
        if self.cfg.name == "forward":
            return eval_model.state_dict()  # the assembled plain model
        # Backward masking evaluates its own model: drop the held-range views and put
        # the full weights back under their plain names.
        state = {k: v for k, v in eval_model.state_dict().items() if "_held_ranges." not in k}
        return {**state, **self.full_parameters()}

    def memory(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        return static_bytes([*self.model.parameters(), *self.subnet.weight_tensors], optimizer)

    def describe(self) -> dict:
        return {
            "granularity": self.cfg.granularity,
            "construction": self.cfg.construction,
            "scale": resolved_scale(self.cfg),
            "resample_every": self.cfg.resample_every,
            "mask": self.stats,
            "shared_params": self.shared_params,
        }


def _check_plan(plan: SubnetPlan, cfg: MaskingConfig, *, family: str, workers: int, fsdp_degree: int) -> None:
    """A plan handed to a strategy must be the plan of its config, family, K and F."""
    got = (plan.cfg, plan.family, plan.workers, plan.fsdp_degree)
    if got != (cfg, family, workers, fsdp_degree):
        raise ValueError(
            f"the plan (masking, family, workers, fsdp_degree) = {got} is not this strategy's "
            f"{(cfg, family, workers, fsdp_degree)}"
        )
