"""Masks: r holders per unit, balanced loads, determinism, spectral gap, errors."""

import numpy as np
import pytest

from sdp.errors import ConfigError
from sdp.subnet.mask import build_mask, holders_per_unit, mask_stats

SIZES = [344, 2, 344, 2, 1, 1, 1, 1]
KINDS = ["ffn", "heads", "ffn", "heads", "block", "block", "block", "block"]


@pytest.mark.parametrize(
    "k,coverage,r", [(4, 0.25, 1), (4, 0.5, 2), (4, 0.75, 3), (4, 1.0, 4), (8, 0.5, 4), (3, 2 / 3, 2)]
)
def test_cyclic_mask_has_r_holders_and_equal_loads(k, coverage, r):
    mask = build_mask(SIZES, num_workers=k, coverage=coverage, group_kinds=KINDS)
    m = mask.matrix()
    assert m.shape == (k, sum(SIZES))
    assert (m.sum(axis=0) == r).all()
    # Each worker holds r of the K chunks of every group.
    for g in range(len(SIZES)):
        held = [len(mask.held_units(w, g)) for w in range(k)]
        assert sum(held) == r * SIZES[g]
        assert max(held) - min(held) <= r
    ffn = [sum(len(mask.held_units(w, g)) for g in (0, 2)) for w in range(k)]
    assert max(ffn) - min(ffn) <= r  # rotation spreads the larger chunks


def test_mask_is_a_pure_function_of_its_inputs():
    a = build_mask(SIZES, num_workers=4, coverage=0.5, construction="random", seed=3, group_kinds=KINDS)
    b = build_mask(SIZES, num_workers=4, coverage=0.5, construction="random", seed=3, group_kinds=KINDS)
    c = build_mask(SIZES, num_workers=4, coverage=0.5, construction="random", seed=4, group_kinds=KINDS)
    assert np.array_equal(a.matrix(), b.matrix())
    assert not np.array_equal(a.matrix(), c.matrix())
    assert (a.matrix().sum(axis=0) == 2).all()


def test_blocks_interleave_through_depth():
    mask = build_mask([1] * 8, num_workers=4, coverage=0.25)
    assert [mask.held_units(0, g).size for g in range(8)] == [1, 0, 0, 0, 1, 0, 0, 0]
    assert mask.unit_holders(5) == [(1,)]


def test_full_coverage_is_one_holder_set():
    mask = build_mask(SIZES, num_workers=4, coverage=1.0, group_kinds=KINDS)
    assert mask.holder_sets() == [(0, 1, 2, 3)]
    assert mask_stats(mask, [1] * len(SIZES))["spectral_gap"] == pytest.approx(1.0)


def test_spectral_gap_orders_the_overlaps():
    gaps = [
        mask_stats(build_mask([64] * 4, num_workers=4, coverage=c), [1] * 4)["spectral_gap"] for c in (0.25, 0.5, 0.75)
    ]
    assert gaps[0] == pytest.approx(0.0)  # r = 1: workers never average together
    assert 0 < gaps[1] < gaps[2] < 1


@pytest.mark.parametrize("k,coverage", [(4, 0.5), (8, 0.5), (8, 0.25), (6, 1 / 3)])
def test_the_blocked_mask_is_balanced_and_never_mixes_its_blocks(k, coverage):
    r = round(k * coverage)
    mask = build_mask(SIZES, num_workers=k, coverage=coverage, construction="blocked", group_kinds=KINDS)
    assert mask.holder_sets() == [tuple(range(b, b + r)) for b in range(0, k, r)]
    assert (mask.matrix().sum(axis=0) == r).all()
    for g in range(len(SIZES)):
        held = [len(mask.held_units(w, g)) for w in range(k)]
        assert sum(held) == r * SIZES[g] and max(held) - min(held) <= r
    cyclic = build_mask(SIZES, num_workers=k, coverage=coverage, group_kinds=KINDS)
    stats = [mask_stats(m, [3, 100, 3, 100, 7, 7, 7, 7]) for m in (mask, cyclic)]
    assert stats[0]["spectral_gap"] == pytest.approx(0.0) and stats[1]["spectral_gap"] > 0.1


def test_a_blocked_mask_needs_its_holders_to_divide_the_workers():
    with pytest.raises(ConfigError) as info:
        build_mask(SIZES, num_workers=4, coverage=0.75, construction="blocked")
    assert str(info.value) == (
        "masking.construction='blocked': needs the 3 holders per unit (C x K) to divide the 4 workers, "
        "which it splits into blocks"
    )
    assert build_mask(SIZES, num_workers=4, coverage=1.0, construction="blocked").holder_sets() == [(0, 1, 2, 3)]


def test_stats_report_coverage_per_worker():
    stats = mask_stats(build_mask(SIZES, num_workers=4, coverage=0.5, group_kinds=KINDS), [3, 100, 3, 100, 7, 7, 7, 7])
    assert stats["holders_min"] == stats["holders_max"] == 2
    assert stats["coverage_per_worker"] == pytest.approx([0.5] * 4, abs=0.02)


@pytest.mark.parametrize(
    "coverage,k,fragment",
    [
        (0.0, 4, "must be in (0, 1]"),
        (1.5, 4, "must be in (0, 1]"),
        (0.1, 4, "0.1 x 4 = 0.4 holders per unit"),
        # The coverage a run reports is the one it trains with: C x K is not rounded.
        (0.3, 4, "allowed with K=4 workers: 0.25, 0.5, 0.75, 1"),
        (0.5, 1, "allowed with K=1 workers: 1"),
    ],
)
def test_impossible_requests_are_refused(coverage, k, fragment):
    with pytest.raises(ConfigError, match="masking.coverage") as info:
        holders_per_unit(coverage, k)
    assert fragment in str(info.value)


def test_unknown_construction():
    with pytest.raises(ConfigError, match="masking.construction='striped': allowed: cyclic, random, blocked"):
        build_mask([4], num_workers=2, coverage=0.5, construction="striped")


@pytest.mark.parametrize("construction", ["cyclic", "random", "blocked"])
def test_every_chunk_is_sent_by_one_of_its_holders(construction):
    mask = build_mask(SIZES, num_workers=4, coverage=0.5, construction=construction, group_kinds=KINDS)
    for holders, sources in zip(mask.chunk_holders, mask.chunk_source, strict=True):
        assert all(src in hs for hs, src in zip(holders, sources, strict=True))
    if construction != "random":  # each worker sends exactly one chunk of every group
        assert all(sorted(sources) == [0, 1, 2, 3] for sources in mask.chunk_source)


def _runs(mask, worker: int, group: int) -> int:
    """Contiguous runs of unit indices `worker` holds in `group`."""
    held = mask.held_units(worker, group)
    return int(held.size > 0) + int(np.count_nonzero(np.diff(held) > 1))


@pytest.mark.parametrize("construction", ["cyclic", "random", "blocked"])
def test_resampled_masks_keep_the_invariants_and_change_the_subnetworks(construction):
    k, r = 4, 2
    base = build_mask(SIZES, num_workers=k, coverage=0.5, construction=construction, group_kinds=KINDS)
    epochs = [
        build_mask(SIZES, num_workers=k, coverage=0.5, construction=construction, group_kinds=KINDS, epoch=e)
        for e in range(1, 6)
    ]
    again = build_mask(SIZES, num_workers=k, coverage=0.5, construction=construction, group_kinds=KINDS, epoch=1)
    assert np.array_equal(again.matrix(), epochs[0].matrix())  # a pure function of (seed, epoch)
    for mask in epochs:
        assert (mask.matrix().sum(axis=0) == r).all()
        for g, n in enumerate(SIZES):
            held = [mask.held_units(w, g).size for w in range(k)]
            assert sum(held) == r * n
            if construction != "random":
                assert max(held) - min(held) <= r
            # Shifted chunk boundaries wrap around at most once per chunk: each of a
            # worker's r chunks is at most two contiguous runs.
            assert all(_runs(mask, w, g) <= 2 * r for w in range(k))
        if construction != "random":  # each kind's block loads are epoch 0's, handed to other workers
            blocks = sorted(sum(mask.held_units(w, g).size for g in range(4, 8)) for w in range(k))
            assert blocks == sorted(sum(base.held_units(w, g).size for g in range(4, 8)) for w in range(k))
    distinct = {base.matrix().tobytes(), *(m.matrix().tobytes() for m in epochs)}
    assert len(distinct) == 6
    # Over the epochs, a worker's FFN units of layer 0 do not stay the same set.
    firsts = {tuple(m.held_units(0, 0)) for m in epochs}
    assert len(firsts) > 1
