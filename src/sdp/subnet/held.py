"""Backward masking's trainable held ranges: Parameters that view a full weight.

The forward always uses the full weight (every worker runs the full model);
the backward produces gradients only for this rank's held ranges:

- for the weight of an `nn.Linear` or `nn.Conv2d` (the bulk of every model),
  the weight-gradient products are computed for the held rows or columns only,
  one product per contiguous run of held units, so a non-held unit costs neither
  the memory nor the FLOPs of its gradient;
- for other sliced tensors (biases, norm scales, Swin's relative-position
  table: vectors and small tables) the full gradient is formed by autograd and
  narrowed to the held ranges.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.grad import conv2d_input, conv2d_weight

from sdp.subnet.layout import outer_layout


def _outer(t: torch.Tensor, dim: int) -> bool:
    """Whether `t` keeps dimension `dim` > 0 outermost in memory (sdp.subnet.layout.outer_layout)."""
    return dim > 0 and t.stride(dim) > t.stride(0)


class _HeldView(torch.autograd.Function):
    """The full tensor in the forward; its gradient narrowed to the held runs in the backward."""

    @staticmethod
    def forward(ctx, full, dim, runs, *pieces):
        ctx.dim, ctx.runs, ctx.outer = dim, runs, _outer(full, dim)
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad):
        parts = [grad.narrow(ctx.dim, s, n) for s, n, _ in ctx.runs]
        # Each in its pieces' layout, and its own (a view would keep the full gradient alive).
        parts = [outer_layout(g, ctx.dim) if ctx.outer else g.clone() for g in parts]
        return (None, None, None, *_split(parts, ctx.runs, ctx.dim))


class _HeldLinear(torch.autograd.Function):
    """y = x W^T + b with W's gradient computed only on the held rows (dim 0) or columns (dim 1)."""

    @staticmethod
    def forward(ctx, x, weight, bias, dim, runs, *pieces):
        ctx.save_for_backward(x, weight)
        ctx.dim, ctx.runs, ctx.has_bias, ctx.outer = dim, runs, bias is not None, _outer(weight, dim)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        # Under autocast the forward computed in grad_y's dtype (bf16): so does the backward.
        x, weight = (t.to(grad_y.dtype) for t in ctx.saved_tensors)
        grad_x = grad_y.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_b = grad_y.reshape(-1, grad_y.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        g2, x2 = grad_y.reshape(-1, grad_y.shape[-1]), x.reshape(-1, x.shape[-1])
        if ctx.dim == 0:
            parts = [g2[:, s : s + n].t().matmul(x2) for s, n, _ in ctx.runs]
        elif ctx.outer:  # columns kept as rows of the transpose: each run's gradient made in that layout
            parts = [x2[:, s : s + n].t().matmul(g2).t() for s, n, _ in ctx.runs]
        else:
            parts = [g2.t().matmul(x2[:, s : s + n]) for s, n, _ in ctx.runs]
        return (grad_x, None, grad_b, None, None, *_split(parts, ctx.runs, ctx.dim))


class _HeldConv2d(torch.autograd.Function):
    """conv2d with the weight's gradient computed only on held output (dim 0) or input (dim 1) channels."""

    @staticmethod
    def forward(ctx, x, weight, bias, conv, dim, runs, *pieces):
        ctx.save_for_backward(x, weight)
        ctx.conv, ctx.dim, ctx.runs, ctx.has_bias = conv, dim, runs, bias is not None
        ctx.outer = _outer(weight, dim)
        return F.conv2d(x, weight, bias, *conv)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = (t.to(grad_y.dtype) for t in ctx.saved_tensors)
        stride, padding, dilation, groups = ctx.conv
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = conv2d_input(x.shape, weight, grad_y, stride, padding, dilation, groups)
        grad_b = grad_y.sum((0, 2, 3)) if ctx.has_bias and ctx.needs_input_grad[2] else None
        kernel = weight.shape[2:]
        if ctx.dim == 0:
            parts = [
                conv2d_weight(x, (n, weight.shape[1], *kernel), grad_y[:, s : s + n], stride, padding, dilation)
                for s, n, _ in ctx.runs
            ]
        else:
            parts = [
                conv2d_weight(x[:, s : s + n], (weight.shape[0], n, *kernel), grad_y, stride, padding, dilation)
                for s, n, _ in ctx.runs
            ]
            if ctx.outer:  # in its pieces' layout
                parts = [outer_layout(p, 1) for p in parts]
        return (grad_x, None, grad_b, None, None, None, *_split(parts, ctx.runs, ctx.dim))


def _eager(forward):
    """`forward`, run eagerly inside a compiled block (a graph break): its held ranges are Python
    constants that dynamo would specialise on, one graph per layer and per mask epoch."""
    return torch._dynamo.disable(forward, recursive=True)


def _split(parts: list[torch.Tensor], runs: tuple, dim: int) -> list[torch.Tensor]:
    """Each run's gradient cut into its pieces' (views: autograd gives each piece its own, no copy)."""
    return [g for part, (_, _, widths) in zip(parts, runs, strict=True) for g in part.split(widths, dim)]


def held_runs(ranges: list) -> tuple[list[int], tuple]:
    """The order of `ranges` by position, and their contiguous runs in that order as
    (start, length, the lengths of the ranges it joins)."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    runs: list[tuple] = []
    for i in order:
        start, n = ranges[i]
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + n, (*runs[-1][2], n))
        else:
            runs.append((start, n, (n,)))
    return order, tuple(runs)


def install_held(module: nn.Module, attr: str, full: torch.Tensor, dim: int, ranges: list) -> list[nn.Parameter]:
    """Make `module.<attr>` the full tensor with trainable views on `ranges`; returns the views
    (in the order of `ranges`).

    The views share the full tensor's storage: an optimizer step on them updates the weights
    the next forward reads, and no held value is stored twice. Each is dense where `full` keeps
    `dim` outermost (`sdp.subnet.layout.outer_layout`) or `dim` is 0, and so is its gradient.
    The backward makes the gradients of ranges side by side (a worker's chunks: a run) in one
    product, and gives each range its part of it.
    """
    order, runs = held_runs(ranges)
    pieces = [nn.Parameter(full.narrow(dim, *ranges[i])) for i in order]
    del module._parameters[attr]
    module.register_buffer(f"{attr}_full", full, persistent=False)
    plist = nn.ParameterList(pieces)
    module.add_module(f"{attr}_held_ranges", plist)
    object.__setattr__(module, attr, full)  # current values outside a forward too
    if attr == "weight" and type(module) is nn.Linear:

        def linear_forward(x):
            return _HeldLinear.apply(x, full, module.bias, dim, runs, *plist)

        module.forward = _eager(linear_forward)
    elif (
        attr == "weight"
        and type(module) is nn.Conv2d
        and module.groups == 1
        and module.padding_mode == "zeros"
        and isinstance(module.padding, tuple)
    ):
        conv = (module.stride, module.padding, module.dilation, module.groups)

        def conv_forward(x):
            return _HeldConv2d.apply(x, full, module.bias, conv, dim, runs, *plist)

        module.forward = _eager(conv_forward)
    else:

        def pre_hook(mod, args):
            object.__setattr__(mod, attr, _HeldView.apply(full, dim, runs, *plist))

        module.register_forward_pre_hook(pre_hook)
    in_order = [None] * len(ranges)
    for k, i in enumerate(order):
        in_order[i] = pieces[k]
    return in_order
