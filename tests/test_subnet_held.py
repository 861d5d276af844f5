"""Backward masking's held ranges: the held-only gradient kernels match autograd on the full weight."""

import pytest
import torch
from torch import nn

from sdp.subnet.held import install_held

RANGES = [(1, 3), (6, 2)]  # two held runs, as a worker holding two non-adjacent chunks has


def _pair(kind: str, bias: bool):
    torch.manual_seed(0)
    if kind == "linear":
        plain = nn.Linear(10, 12, bias=bias)
        x = torch.randn(2, 5, 10)
    else:
        plain = nn.Conv2d(10, 12, 3, padding=1, stride=2, bias=bias)
        x = torch.randn(2, 10, 9, 9)
    held = type(plain)(
        *([10, 12] if kind == "linear" else [10, 12, 3]),
        bias=bias,
        **({} if kind == "linear" else {"padding": 1, "stride": 2}),
    )
    held.load_state_dict(plain.state_dict())
    return plain, held, x


@pytest.mark.parametrize("kind", ["linear", "conv"])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("bias", [False, True])
def test_held_kernels_match_the_full_gradient_on_held_ranges(kind, dim, bias):
    plain, held, x = _pair(kind, bias)
    pieces = install_held(held, "weight", held.weight.detach(), dim, RANGES)
    assert held.forward is not type(held).forward  # the held-only kernel is in use

    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = plain(x1), held(x2)
    torch.testing.assert_close(y2, y1, rtol=0, atol=0)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-6)
    for piece, (start, n) in zip(pieces, RANGES, strict=True):
        torch.testing.assert_close(piece.grad, plain.weight.grad.narrow(dim, start, n), rtol=1e-5, atol=1e-6)
    if bias:
        torch.testing.assert_close(held.bias.grad, plain.bias.grad, rtol=1e-5, atol=1e-6)


def test_held_views_share_the_full_weight():
    _, held, _ = _pair("linear", False)
    full = held.weight.detach()
    (piece,) = install_held(held, "weight", full, 0, [(2, 4)])
    with torch.no_grad():
        piece.add_(1.0)  # an optimizer step on the held range ...
    assert torch.equal(held.weight_full[2:6], piece.detach())  # ... is what the next forward reads
    assert piece.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()


def test_small_tensors_narrow_the_autograd_gradient():
    torch.manual_seed(0)
    plain, held = nn.LayerNorm(8), nn.LayerNorm(8)
    with torch.no_grad():
        plain.weight.uniform_(), held.weight.copy_(plain.weight)
    (piece,) = install_held(held, "weight", held.weight.detach(), 0, [(3, 4)])
    x = torch.randn(5, 8)
    plain(x).pow(2).sum().backward()
    held(x).pow(2).sum().backward()
    torch.testing.assert_close(piece.grad, plain.weight.grad[3:7])
