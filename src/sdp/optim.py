"""Optimizers and learning-rate schedules."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from enum import StrEnum

import torch

from sdp.dist import is_dtensor
from sdp.errors import ConfigError
from sdp.metrics.launches import is_dense


class Optimizer(StrEnum):
    adamw = "adamw"
    sgd = "sgd"


class Schedule(StrEnum):
    """optim.schedule, after a linear warmup."""

    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class Implementation(StrEnum):
    auto = "auto"
    fused = "fused"
    foreach = "foreach"


@dataclass
class OptimConfig:
    name: Optimizer = Optimizer.adamw
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    momentum: float = 0.9
    nesterov: bool = False
    schedule: Schedule = Schedule.cosine
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # final lr = min_lr_ratio * lr
    # fused: one kernel for the whole update, which can also skip it on the device (the NaN/Inf
    # guard's found_inf, see sdp.run.nonfinite); foreach: torch's multi-tensor one. auto: fused on
    # CUDA where every trained tensor is dense (every variant's are: sdp.subnet.layout), torch's
    # default elsewhere (on CPU its per-tensor loop: the CPU results so far). Neuron SDP x FSDP of a
    # ResNet or Swin trains DTensors beside plain tensors, which no multi-tensor update takes in one
    # call: they are two parameter groups, each updated in one (`by_kind`).
    implementation: Implementation = Implementation.auto


# Words of torch's own refusals (its optimizers' ValueErrors) and the key each one means.
TORCH_WORDS = {"learning rate": "lr", "weight_decay": "weight_decay", "beta": "betas", "epsilon": "eps"}


def validate_optim(cfg: OptimConfig) -> None:
    """Reject values the optimizer or schedule cannot use: ours, then torch's own range checks,
    by building the optimizer over one scalar (each refusal names the key it is about)."""
    if not cfg.lr > 0:
        raise ConfigError("optim.lr", cfg.lr, "must be > 0")
    if cfg.warmup_steps < 0:
        raise ConfigError("optim.warmup_steps", cfg.warmup_steps, "must be >= 0")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise ConfigError("optim.min_lr_ratio", cfg.min_lr_ratio, "must be in [0, 1]")
    if cfg.name == "adamw" and (len(cfg.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.betas)):
        raise ConfigError("optim.betas", cfg.betas, "must be two numbers in [0, 1)")
    if cfg.name == "sgd" and cfg.nesterov and not cfg.momentum > 0:
        raise ConfigError("optim.momentum", cfg.momentum, "must be > 0 with optim.nesterov=true")
    for key in ("weight_decay", "eps", "momentum"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"optim.{key}", getattr(cfg, key), "must be >= 0")
    try:
        build_optimizer([torch.zeros(1, requires_grad=True)], replace(cfg, implementation=Implementation.auto))
    except (ValueError, RuntimeError) as err:
        key = next((k for word, k in TORCH_WORDS.items() if word in str(err).lower()), "name")
        raise ConfigError(f"optim.{key}", getattr(cfg, key), f"refused by torch: {err}") from None


def is_fused(cfg: OptimConfig, device: torch.device | None) -> bool:
    """Whether optim.implementation gives the fused kernels on `device` (None: CPU)."""
    return cfg.implementation == "fused" or (
        cfg.implementation == "auto" and device is not None and device.type == "cuda"
    )


def mixes_dtensors(tensors: list[torch.Tensor]) -> bool:
    """Whether `tensors` hold both DTensors and plain tensors."""
    return len({is_dtensor(t) for t in tensors}) == 2


def by_kind(tensors: list[torch.Tensor]) -> list[dict]:
    """Parameter groups that torch's fused and foreach updates each take in one call: the DTensors,
    then the plain tensors (neuron SDP x FSDP of a ResNet or Swin trains FSDP's sharded weights
    beside the replicated biases and norms; one call refuses the mix)."""
    return [{"params": [t for t in tensors if is_dtensor(t)]}, {"params": [t for t in tensors if not is_dtensor(t)]}]


def _tensors(params) -> list[torch.Tensor]:
    return [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]


def build_optimizer(
    params, cfg: OptimConfig, *, device: torch.device | None = None, default_foreach: bool | None = None
) -> torch.optim.Optimizer:
    """Build the optimizer over `params` (only the tensors this rank trains) on `device`.
    `default_foreach`: what torch's own choice (foreach=None) is to be, where the tensors are
    not on `device` (the memory estimator's fake CPU tensors stand for CUDA ones, where torch
    chooses foreach); None: torch chooses by the tensors' device. DTensors beside plain tensors
    are two parameter groups (`by_kind`), each updated in one call."""
    tensors = _tensors(list(params))
    params = by_kind(tensors) if mixes_dtensors(tensors) else tensors
    fused = is_fused(cfg, device)
    if fused and device is not None and device.type == "cuda" and not all(map(is_dense, tensors)):
        if cfg.implementation == "fused":
            raise ConfigError(
                "optim.implementation",
                "fused",
                "CUDA's fused kernels take dense tensors only, and this run trains a strided view (some columns "
                "of a matrix): use optim.implementation=auto or foreach",
            )
        fused = False  # auto: torch's default, and the NaN/Inf check on the host
    if fused:
        kind = {"fused": True}
    else:
        kind = {"foreach": True if cfg.implementation == "foreach" else default_foreach}
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, **kind
        )
    return torch.optim.SGD(
        params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay, **kind
    )


def lr_factor(step: int, *, cfg: OptimConfig, max_steps: int) -> float:
    """Multiplier of the base lr at `step` (0-based): linear warmup, then decay to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, progress)
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, *, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg=cfg, max_steps=max_steps))


def rebind(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], state: dict) -> None:
    """Point the optimizer at new parameters with the given state (SDP's mask resampling), split
    into its groups as `build_optimizer` split them; its hyperparameters and the lr schedule
    driving it carry on."""
    groups = by_kind(list(params)) if len(optimizer.param_groups) == 2 else [{"params": list(params)}]
    if len(optimizer.param_groups) not in (1, 2):
        raise ValueError(f"rebind needs an optimizer of one or two parameter groups, got {len(optimizer.param_groups)}")
    for group, new in zip(optimizer.param_groups, groups, strict=True):
        group["params"] = new["params"]
    optimizer.state = defaultdict(dict, state)


def state_by_name(optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor], convert=lambda t: t):
    """The optimizer state of `params` (plain name -> parameter) by plain name: ({key: {name:
    tensor}} for the state shaped like its parameter, {key: tensor} for the scalar state, which
    is the same for every parameter (Adam's step: all of them are stepped every step)), each
    tensor passed through `convert` (to the host, unsharded)."""
    per_key: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        for key, value in optimizer.state.get(p, {}).items():
            if not torch.is_tensor(value):
                continue
            if value.shape == p.shape:
                per_key.setdefault(key, {})[name] = convert(value)
            elif key not in scalars:
                scalars[key] = convert(value)
    return per_key, scalars


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each parameter group's settings as the lr schedule left them (its current lr among them)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def regrouped(groups: list, n: int) -> list:
    """`groups` (a saved optimizer's settings, or a schedule's values a group) for `n` groups:
    as they are, or one setting shared by every saved group repeated (a checkpoint of one group
    resumed where DTensors and plain tensors are two, or the other way)."""
    if len(groups) == n:
        return list(groups)
    if groups and all(g == groups[0] for g in groups):
        return [groups[0]] * n
    raise ValueError(f"the saved optimizer has {len(groups)} parameter groups, this one {n}")


def load_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler, state: dict) -> None:
    """`scheduler.load_state_dict(state)`, its values a group fitted to the optimizer's groups
    (`regrouped`)."""
    n = len(scheduler.optimizer.param_groups)
    state = {k: regrouped(v, n) if k in ("base_lrs", "_last_lr") else v for k, v in state.items()}
    scheduler.load_state_dict(state)


def set_state(optimizer: torch.optim.Optimizer, state: dict, groups: list[dict]) -> None:
    """Give `optimizer` this state (parameter -> {key: tensor}) and these group settings, placed
    on the devices its own policy wants (a fused AdamW's step on the device), as
    load_state_dict would place a saved state."""
    groups = regrouped(groups, len(optimizer.param_groups))
    index = {p: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    optimizer.load_state_dict(
        {
            "state": {index[p]: st for p, st in state.items()},
            "param_groups": [
                {**saved, "params": [index[p] for p in group["params"]]}
                for saved, group in zip(groups, optimizer.param_groups, strict=True)
            ],
        }
    )
