"""The baselines reviewers asked for: structured dropout and stochastic depth at SDP's keep rate.

Both are data-parallel runs (every rank holds and trains the whole model) whose
training forward drops the same units SDP would, at random and per sample,
with keep probability C = masking.coverage, and rescales by 1/C; evaluation
runs the whole model unchanged.

- `masking=dropout`: the neuron units (MLP hidden units, attention heads or KV
  groups, a BasicBlock's inner channels) are zeroed where they enter their
  output projection (down_proj / o_proj / fc2 / proj / conv2).
- `masking=stochastic_depth`: a block's whole residual branch is dropped (both
  the attention and the MLP outputs of a transformer layer together, as
  block-level SDP drops the layer).

Masks are drawn from the torch RNG, which the run seeds per rank, so ranks
drop different units and a resumed run draws the same masks again. Under
Swin's window attention the leading dimension is image x window: each window
row gets its image's mask for stochastic depth, its own for dropout.
"""

from __future__ import annotations

import torch
from torch import nn

from sdp.subnet import BASELINE_NAMES
from sdp.subnet.units import unit_spec


def _per_sample(n: int, keep: float, *, like: torch.Tensor, units: int = 1) -> torch.Tensor:
    """Bernoulli(keep) / keep, shaped (n, units)."""
    return torch.rand(n, units, device=like.device).lt(keep).to(like.dtype).div_(keep)


def _dropout_site(module: nn.Module, feature_unit: torch.Tensor, n_units: int, keep: float, conv: bool):
    def hook(mod, args):
        if not mod.training:
            return None
        x = args[0]
        per_feature = _per_sample(x.shape[0], keep, like=x, units=n_units)[:, feature_unit.to(x.device)]
        shape = (x.shape[0], -1, *([1] * (x.dim() - 2))) if conv else (x.shape[0], *([1] * (x.dim() - 2)), -1)
        return (x * per_feature.view(shape), *args[1:])

    return module.register_forward_pre_hook(hook)


def _block_site(block: nn.Module, outputs: list[nn.Module], keep: float) -> list:
    state: dict[str, torch.Tensor | None] = {"mask": None}

    def draw(mod, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states")  # transformers may pass it by name
        state["mask"] = _per_sample(x.shape[0], keep, like=x).flatten() if mod.training else None

    def apply(mod, args, out):
        mask = state["mask"]
        if mask is None:
            return None
        per_row = mask.repeat_interleave(out.shape[0] // mask.shape[0])  # windows of one image share it
        return out * per_row.view(-1, *([1] * (out.dim() - 1))).to(out.dtype)

    return [block.register_forward_pre_hook(draw, with_kwargs=True)] + [m.register_forward_hook(apply) for m in outputs]


class Baseline:
    """A baseline of `masking.name`: DDP with SDP's units of `granularity` dropped at random by
    `apply` (hooks on a plain model's training forward), named `title` in tables."""

    name = title = granularity = ""

    def apply(self, model: nn.Module, spec, *, keep: float) -> None:
        raise NotImplementedError


class Dropout(Baseline):
    """Structured dropout: each neuron unit zeroed where it enters its output projection."""

    name, title, granularity = "dropout", "Dropout", "neuron"

    def apply(self, model: nn.Module, spec, *, keep: float) -> None:
        for group in spec.groups:
            (out,) = group.outputs
            module = model.get_submodule(out)
            weight = next(s for s in group.slices if s.name == f"{out}.weight")  # sliced along its inputs
            feature_unit = torch.empty(weight.index.numel(), dtype=torch.long)
            units = torch.arange(group.num_units).repeat_interleave(weight.index.shape[1])
            feature_unit[weight.index.reshape(-1)] = units
            _dropout_site(module, feature_unit, group.num_units, keep, conv=isinstance(module, nn.Conv2d))


class StochasticDepth(Baseline):
    """Stochastic depth: a block's whole residual branch dropped."""

    name, title, granularity = "stochastic_depth", "Stochastic depth", "block"

    def apply(self, model: nn.Module, spec, *, keep: float) -> None:
        for group in spec.groups:
            _block_site(model.get_submodule(group.name), [model.get_submodule(o) for o in group.outputs], keep)


BASELINES: dict[str, Baseline] = {b.name: b for b in (Dropout(), StochasticDepth())}
assert tuple(BASELINES) == BASELINE_NAMES  # the names the config accepts (sdp.subnet)


def apply_unit_noise(model: nn.Module, *, family: str, kind: str, keep: float) -> int:
    """Hook the training forward of a plain model for baseline `kind` (dropout |
    stochastic_depth) at keep rate `keep`; returns the number of unit groups hooked."""
    baseline = BASELINES[kind]
    spec = unit_spec(model, family=family, granularity=baseline.granularity)
    baseline.apply(model, spec, keep=keep)
    return len(spec.groups)
