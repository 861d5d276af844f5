"""Backward masking's trainable held ranges: Parameters that view a full weight.

The forward always uses the full weight (every worker runs the full model);
the backward produces gradients only for this rank's held ranges:

- for the weight of an `nn.Linear` or `nn.Conv2d` (the bulk of every model),
  the weight-gradient products are computed for the held rows or columns only,
  so a non-held unit costs neither the memory nor the FLOPs of its gradient;
- for other sliced tensors (biases, norm scales, Swin's relative-position
  table: vectors and small tables) the full gradient is formed by autograd and
  narrowed to the held ranges.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.grad import conv2d_input, conv2d_weight


class _HeldView(torch.autograd.Function):
    """The full tensor in the forward; its gradient narrowed to the held ranges in the backward."""

    @staticmethod
    def forward(ctx, full, dim, ranges, *pieces):
        ctx.dim, ctx.ranges = dim, ranges
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, *[grad.narrow(ctx.dim, s, n).clone() for s, n in ctx.ranges])


class _HeldLinear(torch.autograd.Function):
    """y = x W^T + b with W's gradient computed only on the held rows (dim 0) or columns (dim 1)."""

    @staticmethod
    def forward(ctx, x, weight, bias, dim, ranges, *pieces):
        ctx.save_for_backward(x, weight)
        ctx.dim, ctx.ranges, ctx.has_bias = dim, ranges, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        # Under autocast the forward computed in grad_y's dtype (bf16): so does the backward.
        x, weight = (t.to(grad_y.dtype) for t in ctx.saved_tensors)
        grad_x = grad_y.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_b = grad_y.reshape(-1, grad_y.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        g2, x2 = grad_y.reshape(-1, grad_y.shape[-1]), x.reshape(-1, x.shape[-1])
        if ctx.dim == 0:
            pieces = [g2[:, s : s + n].t().matmul(x2) for s, n in ctx.ranges]
        else:
            pieces = [g2.t().matmul(x2[:, s : s + n]) for s, n in ctx.ranges]
        return (grad_x, None, grad_b, None, None, *pieces)


class _HeldConv2d(torch.autograd.Function):
    """conv2d with the weight's gradient computed only on held output (dim 0) or input (dim 1) channels."""

    @staticmethod
    def forward(ctx, x, weight, bias, conv, dim, ranges, *pieces):
        ctx.save_for_backward(x, weight)
        ctx.conv, ctx.dim, ctx.ranges, ctx.has_bias = conv, dim, ranges, bias is not None
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
            pieces = [
                conv2d_weight(x, (n, weight.shape[1], *kernel), grad_y[:, s : s + n], stride, padding, dilation)
                for s, n in ctx.ranges
            ]
        else:
            pieces = [
                conv2d_weight(x[:, s : s + n], (weight.shape[0], n, *kernel), grad_y, stride, padding, dilation)
                for s, n in ctx.ranges
            ]
        return (grad_x, None, grad_b, None, None, None, *pieces)


def _eager(forward):
    """`forward`, run eagerly inside a compiled block (a graph break): its held ranges are Python
    constants that dynamo would specialise on, one graph per layer and per mask epoch."""
    return torch._dynamo.disable(forward, recursive=True)


def install_held(module: nn.Module, attr: str, full: torch.Tensor, dim: int, ranges: list) -> list[nn.Parameter]:
    """Make `module.<attr>` the full tensor with trainable views on `ranges`; returns the views.

    The views share the full tensor's storage: an optimizer step on them
    updates the weights the next forward reads, and no held value is stored twice.
    """
    pieces = [nn.Parameter(full.narrow(dim, s, n)) for s, n in ranges]
    del module._parameters[attr]
    module.register_buffer(f"{attr}_full", full, persistent=False)
    plist = nn.ParameterList(pieces)
    module.add_module(f"{attr}_held_ranges", plist)
    ranges = tuple(ranges)
    object.__setattr__(module, attr, full)  # current values outside a forward too
    if attr == "weight" and type(module) is nn.Linear:

        def linear_forward(x):
            return _HeldLinear.apply(x, full, module.bias, dim, ranges, *plist)

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
            return _HeldConv2d.apply(x, full, module.bias, conv, dim, ranges, *plist)

        module.forward = _eager(conv_forward)
    else:

        def pre_hook(mod, args):
            object.__setattr__(mod, attr, _HeldView.apply(full, dim, ranges, *plist))

        module.register_forward_pre_hook(pre_hook)
    return pieces
