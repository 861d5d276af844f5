"""The gradient sync's packing where a tensor keeps its cut dimension inner (SDP x FSDP: FSDP2
shards rows and takes contiguous parameters only, so a held column range is a strided view):
a bucket packs, writes back and takes norms with a few kernels, not one a piece."""

import torch

from sdp.metrics.launches import LaunchCounter, is_dense
from sdp.subnet.sync import Piece, gather_flat, norm_views, write_strided


def _weight(rows: int = 4, cols: int = 10) -> torch.Tensor:
    w = torch.nn.Parameter(torch.zeros(rows, cols))
    w.grad = torch.arange(rows * cols, dtype=torch.float32).view(rows, cols)
    return w


def _count(fn) -> tuple[object, int]:
    with LaunchCounter() as counter:
        out = fn()
    return out, sum(counter.counts.values())


def test_strided_pieces_pack_with_one_concatenation_a_shape():
    # Two weights of 4 rows; column pieces travel with their column first (Piece.wire); a
    # contiguous row piece of a third tensor with 4 columns joins the same run.
    a, b, rows = _weight(), _weight(cols=6), torch.arange(12.0).view(3, 4)
    views = [Piece(a, 1, 0, 3).wire(a.grad), Piece(b, 1, 2, 4).wire(b.grad), rows, Piece(a, 1, 7, 3).wire(a.grad)]
    assert not any(v.is_contiguous() for v in views[:2])
    flat, launches = _count(lambda: gather_flat(views))
    assert torch.equal(flat, torch.cat([v.reshape(-1) for v in views]))
    assert launches == 1  # all four are [n, 4]: one run
    mixed = [*views, torch.ones(5)]  # another shape: a second run
    flat, launches = _count(lambda: gather_flat(mixed))
    assert torch.equal(flat, torch.cat([v.reshape(-1) for v in mixed])) and launches == 2


def _averages(pieces: list[Piece], grad: torch.Tensor) -> list[tuple[Piece, torch.Tensor]]:
    """Each piece's values (of `grad`) negated, flat in its wire order, as a bucket holds them."""
    return [(p, -p.wire(grad).reshape(-1)) for p in pieces]


def test_pieces_that_tile_a_gradient_are_written_by_one_concatenation():
    w = _weight()
    pieces = [Piece(w, 1, 6, 4), Piece(w, 1, 0, 2), Piece(w, 1, 2, 4)]  # out of order, tiling 0..10
    pending = _averages(pieces, w.grad.clone())
    expected = -w.grad
    _, launches = _count(lambda: write_strided(pending))
    assert torch.equal(w.grad, expected) and launches == 1
    assert w.grad.stride() == (10, 1)  # written into its storage, its layout kept


def test_pieces_that_leave_columns_out_are_copied_one_by_one():
    w = _weight()
    pieces = [Piece(w, 1, 0, 2), Piece(w, 1, 5, 3)]  # columns 2..4 and 8..9 are not synced here
    expected = w.grad.clone()
    for p in pieces:
        p.view(expected).neg_()
    pending = _averages(pieces, w.grad.clone())
    _, launches = _count(lambda: write_strided(pending))
    assert torch.equal(w.grad, expected) and launches == 2


def test_norm_views_are_dense_and_sum_to_the_pieces_norm():
    w, u, v = _weight(), _weight(cols=8), _weight(rows=3, cols=4)
    whole = [Piece(w, 1, 0, 5), Piece(w, 1, 5, 5)]  # tiles w: its whole gradient, no copy
    partial = [Piece(u, 1, 1, 3), Piece(u, 1, 6, 2)]  # strided, partial: copied together
    pieces = [*whole, *partial, Piece(v, 0, 1, 2)]  # rows: contiguous as they are
    views, launches = _count(lambda: norm_views(pieces))
    assert all(is_dense(t) for t in views) and len(views) == 3
    assert views[1].data_ptr() == w.grad.data_ptr()  # no copy of w
    assert launches == 1  # the partial pieces' one concatenation
    norms, launches = _count(lambda: torch._foreach_norm(views, 2, dtype=torch.float64))
    assert launches == 1
    got = sum(n.item() ** 2 for n in norms)
    reference = sum(p.view(p.tensor.grad).double().pow(2).sum().item() for p in pieces)
    assert abs(got - reference) <= 1e-12 * reference
