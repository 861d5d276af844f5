"""What the training loop needs from a data-parallel scheme (`Strategy`), the state a checkpoint
holds in the plain model's coordinates (`PortableState`), and the helpers strategies share."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


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


def move_to(model: nn.Module, device: torch.device) -> nn.Module:
    """Move `model` to `device` in place (Parameter objects are kept, so references to them
    stay valid); a no-op when it is there already, as the memory estimator's fake tensors are."""
    if any(t.device != device for t in [*model.parameters(), *model.buffers()]):
        model.to(device)
    return model


class Strategy:
    """What the training loop needs from a data-parallel scheme.

    Why 17 methods: this is an interface, not an implementation. Each method is one
    question that the trainer, the checkpointer, the meter, the export or the summary asks of
    whichever scheme runs (DDP, FSDP, SDP, SDP x FSDP), and it holds no state of its own.
    The methods with a body are the answer of a scheme that has nothing to do there.
    """

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
