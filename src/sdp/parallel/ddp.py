"""DDP: torch DistributedDataParallel over all ranks, the baseline: every rank holds and trains everything."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sdp.metrics.comm import CommCounter
from sdp.metrics.memory import static_bytes
from sdp.optim import hyperparameters, set_state, state_by_name
from sdp.parallel.config import ParallelConfig
from sdp.parallel.strategy import PortableState, Strategy, host, rank0_buffers


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
        self.model = self.wrap(model, cfg, device=device, comm=comm)
        # Exposed communication: from the last gradient the backward makes to the end of
        # backward(), where DDP's reducer waits for its last buckets.
        self.comm, self._last_grad = comm, None
        # Gradients made so far in this step, and in the step before: the last one is marked
        # (one CUDA event a step, not one per parameter).
        self._made, self._expected = 0, 0
        comm.track_waits()
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_made)

    def wrap(self, model: nn.Module, cfg: ParallelConfig, *, device: torch.device, comm: CommCounter) -> nn.Module:
        """`model` under DistributedDataParallel, its all-reduces counted in `comm`. (The memory
        estimator, which cannot run DDP's reducer on fake tensors, puts its model of it here.)"""
        ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=cfg.bucket_cap_mb,
            # Gradients live in the all-reduce buckets: one copy of them, not two.
            gradient_as_bucket_view=True,
            # A process group whose collectives move nothing (sdp.dist.fake_process_group: one
            # process playing one rank of a job) has no peers: DDP's check that every rank's
            # parameter shapes agree would compare with nothing, its broadcast would move nothing.
            init_sync=dist.get_backend() != "fake",
        )
        ddp.register_comm_hook(comm, _counting_allreduce_hook)
        return ddp

    def _grad_made(self, p) -> None:
        self._made += 1
        if self._made >= self._expected:
            self._last_grad = self.comm.start()

    def after_backward(self) -> None:
        self._made, self._expected = 0, self._made
        if self._last_grad is not None:
            self.comm.stop(self._last_grad)
            self._last_grad = None

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.plain.parameters() if p.requires_grad]

    def no_sync(self):
        return self.model.no_sync()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        # foreach as torch picks it for plain tensors on CUDA and the CPU, said so that a trace under
        # fake tensors (the estimator's), which torch's pick refuses, runs the same kernels.
        return torch.nn.utils.clip_grad_norm_(self.plain.parameters(), max_norm, foreach=True)

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
