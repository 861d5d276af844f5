"""FSDP2 (`fully_shard`) over all ranks: the sharded-data-parallel baseline (`parallelism=fsdp`).

Every block (the family's decoder layers / BasicBlocks / Swin blocks) is one
FSDP unit, then the root takes what is left (embeddings, stem, head): each
rank stores 1/K of every parameter, gradient and optimizer state, all-gathers
a block's weights just before it runs (and again for its backward, with
`parallelism.reshard_after_forward`), and reduce-scatters its gradients.
With `parallelism.mixed_precision=bf16` the gathered weights and the compute
are bf16 while the sharded master weights, optimizer state and gradient
reduction stay fp32. Bytes sent are counted at FSDP's own collectives, through
its custom-communication hooks: the all-gather input is this rank's shard, the
reduce-scatter input the full gradient.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from sdp import dist as sdp_dist
from sdp.dist import local
from sdp.metrics.comm import CommCounter
from sdp.metrics.memory import static_bytes
from sdp.models import blocks
from sdp.optim import hyperparameters, set_state, state_by_name
from sdp.parallel.config import ParallelConfig
from sdp.parallel.strategy import PortableState, Strategy, host, rank0_buffers


def counting_collectives(comm: CommCounter):
    """FSDP2's default all-gather and reduce-scatter, counting the bytes handed to them."""
    # FSDP2's collective classes live in a private module: imported where they are used.
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class CountingAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            nbytes = input_tensor.numel() * input_tensor.element_size()
            comm.add("param_all_gather", nbytes)
            # The host issues a block's all-gather where the block needs it (the step-time model
            # starts it a block earlier, as FSDP's all-gather stream runs ahead).
            comm.need(comm.event("all_gather", "param_all_gather", nbytes, _ranks(group)))
            return super().__call__(output_tensor, input_tensor, group, async_op)

    class CountingReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            nbytes = input_tensor.numel() * input_tensor.element_size()
            comm.add("grad_reduce_scatter", nbytes)
            comm.event("reduce_scatter", "grad_reduce_scatter", nbytes, _ranks(group))  # needed after the backward
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    return CountingAllGather(), CountingReduceScatter()


def _ranks(group) -> tuple[int, ...]:
    return tuple(torch.distributed.get_process_group_ranks(group))


def mixed_precision_policy(cfg: ParallelConfig) -> MixedPrecisionPolicy:
    """bf16 gathered weights and compute with fp32 gradient reduction, or plain fp32."""
    if cfg.mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (the whole tensor, on every rank) sharded like parameter `p` when it is shaped
    like it; scalar state (Adam's step) and values of unsharded parameters are kept whole."""
    if not isinstance(p, DTensor) or value.shape != p.shape:
        return value
    # src_data_rank=None: each rank cuts its own shard from its copy, no communication.
    return distribute_tensor(value.to(local(p).device), p.device_mesh, p.placements, src_data_rank=None)


class FSDPStrategy(Strategy):
    """FSDP2 over all ranks: each rank holds a 1/K shard of everything."""

    def __init__(self, model: nn.Module, cfg: ParallelConfig, *, family: str, device: torch.device, comm: CommCounter):
        world = torch.distributed.get_world_size()
        self.full_params = sum(p.numel() for p in model.parameters())
        self.shared_params = self.full_params
        self.mesh = sdp_dist.device_mesh(device.type, (world,), ("fsdp",))
        mp = mixed_precision_policy(cfg)
        sharded = []
        for _, block in blocks(model, family=family):
            sharded.append(
                fully_shard(block, mesh=self.mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
            )
        sharded.append(fully_shard(model, mesh=self.mesh, mp_policy=mp))
        for module in sharded:
            all_gather, reduce_scatter = counting_collectives(comm)
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)
        self.model, self.comm = model, comm

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def after_backward(self) -> None:
        self.comm.need_pending(("grad_reduce_scatter",))  # FSDP waited for them at the end of backward()

    @contextlib.contextmanager
    def no_sync(self):
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return _full(torch.nn.utils.clip_grad_norm_(self.trainable(), max_norm))

    @contextlib.contextmanager
    def eval_model(self):
        # Buffers are not sharded: each rank's BatchNorm statistics saw its own batches; use rank 0's.
        for buf in self.model.buffers():
            torch.distributed.broadcast(buf, src=0)
        was_training = self.model.training
        self.model.eval()
        try:
            yield self.model  # evaluated sharded: each block gathers its weights as it runs
        finally:
            self.model.train(was_training)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: _full(p.detach()) for n, p in self.model.named_parameters()}

    def portable_state(self, optimizer: torch.optim.Optimizer) -> PortableState:
        # Gathered tensor by tensor in one order on every rank; buffers (not sharded) are rank 0's.
        model = rank0_buffers(self.model, full=_full)
        params = dict(self.model.named_parameters())
        optim, scalars = state_by_name(optimizer, params, convert=lambda t: host(_full(t)))
        return PortableState(model, optim, scalars, hyperparameters(optimizer))

    @torch.no_grad()
    def load_portable_state(self, optimizer: torch.optim.Optimizer, state: PortableState) -> None:
        tensors = self.model.state_dict(keep_vars=True)
        if tensors.keys() != state.model.keys():
            other = sorted(tensors.keys() ^ state.model.keys())[:3]
            raise RuntimeError(f"the checkpoint's model has other tensors (e.g. {other})")
        for name, t in tensors.items():
            local(t).copy_(local(shard_like(t, state.model[name])))
        set_state(optimizer, state.per_parameter(dict(self.model.named_parameters()), place=shard_like), state.groups)

    def plain_state_dict(self, eval_model: nn.Module) -> dict[str, torch.Tensor]:
        """The unsharded state dict under the plain model's names (collective: every rank calls it)."""
        return get_model_state_dict(eval_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def memory(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        return static_bytes(self.model.parameters(), optimizer)

    def describe(self) -> dict:
        return {"shared_params": self.shared_params}
