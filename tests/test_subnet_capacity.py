"""Workers of different capacities (masking.capacity): the arcs mask, its refusals, its config."""

import dataclasses
import math

import numpy as np
import pytest
from conftest import tiny_model_cfg

from sdp.errors import ConfigError
from sdp.models import build_on_meta
from sdp.run.config import load_config, typed_config
from sdp.subnet import MaskingConfig
from sdp.subnet.capacity import capacity_mask, lay_arcs
from sdp.subnet.mask import build_mask, mask_stats
from sdp.subnet.plan import SubnetPlan

SIZES = [344, 2, 344, 2, 37, 1, 1, 1, 1, 1, 1, 1, 1]
KINDS = ["ffn", "heads", "ffn", "heads", "channels"] + ["block"] * 8
NAMES = [f"g{g}" for g in range(len(SIZES))]
MIXED = [[1, 1, 0.5, 0.5], [1, 0.5, 0.5, 0.5], [0.9, 0.7, 0.5, 0.55], [1, 0.75, 0.5, 0.5, 0.5, 0.75], [0.5, 0.5, 1.0]]


def _mixed(capacity, sizes=SIZES, kinds=KINDS, **kw):
    return capacity_mask(sizes, capacity=capacity, group_kinds=kinds, group_names=NAMES[: len(sizes)], **kw)


@pytest.mark.parametrize("capacity", MIXED)
def test_every_unit_has_floor_or_ceil_of_the_total_holders_and_each_worker_its_share(capacity):
    mask = _mixed(capacity, sizes=SIZES[:5], kinds=KINDS[:5])
    total = sum(capacity)
    counts = mask.matrix().sum(axis=0)
    assert set(counts.tolist()) <= {math.floor(total), math.ceil(total)} and counts.min() >= 1
    for g, n in enumerate(SIZES[:5]):
        held = np.array([mask.held_units(w, g).size for w in range(len(capacity))])
        assert np.all(np.abs(held - n * np.array(capacity)) < 1), (g, held)
        assert held.sum() == mask.holder_counts(g).sum()


@pytest.mark.parametrize("capacity", MIXED)
def test_the_blocks_are_shared_by_capacity_across_the_depth(capacity):
    mask = _mixed(capacity)
    blocks = range(5, 13)
    held = np.array([sum(mask.held_units(w, g).size for g in blocks) for w in range(len(capacity))])
    assert np.all(np.abs(held - 8 * np.array(capacity)) < 1), held
    counts = np.array([mask.holder_counts(g)[0] for g in blocks])
    assert set(counts.tolist()) <= {math.floor(sum(capacity)), math.ceil(sum(capacity))}


def test_a_small_worker_holds_blocks_spread_through_the_depth():
    mask = _mixed([1, 1, 0.5, 0.5], sizes=[1] * 8, kinds=["block"] * 8)
    # Residue order (l mod 4, l div 4): 0 4 1 5 | 2 6 3 7; worker 2's arc is the first half.
    assert [g for g in range(8) if mask.held_units(2, g).size] == [0, 1, 4, 5]
    assert [g for g in range(8) if mask.held_units(3, g).size] == [2, 3, 6, 7]


def test_the_arcs_are_laid_end_to_end():
    member = lay_arcs(8, [1, 0.5, 0.75])
    assert member.astype(int).tolist() == [
        [1, 1, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 1, 1, 1],
    ]


def test_the_holder_sets_are_the_same_few_in_every_group_and_epoch():
    base = _mixed([1, 0.5, 0.5, 0.5])
    assert base.holder_sets() == [(0, 2), (0, 1, 3)]
    for epoch in (1, 2, 3):
        mask = _mixed([1, 0.5, 0.5, 0.5], epoch=epoch)
        assert mask.holder_sets() == base.holder_sets()
        for g in range(5):  # every neuron group: the same loads, other units
            assert [mask.held_units(w, g).size for w in range(4)] == [base.held_units(w, g).size for w in range(4)]
        blocks = [[sum(m.held_units(w, g).size for g in range(5, 13)) for w in range(4)] for m in (mask, base)]
        assert blocks[0] == blocks[1]  # as many blocks as before, others
    moved = {tuple(_mixed([1, 0.5, 0.5, 0.5], epoch=e).held_units(1, 0)) for e in range(4)}
    assert len(moved) == 4
    again = _mixed([1, 0.5, 0.5, 0.5], epoch=2, seed=0)
    assert np.array_equal(again.matrix(), _mixed([1, 0.5, 0.5, 0.5], epoch=2, seed=0).matrix())


@pytest.mark.parametrize("construction", ["cyclic", "random", "blocked"])
@pytest.mark.parametrize("epoch", [0, 2])
def test_equal_capacities_are_the_uniform_mask(construction, epoch):
    uniform = build_mask(SIZES, num_workers=4, coverage=0.5, construction=construction, group_kinds=KINDS, epoch=epoch)
    equal = _mixed([0.5] * 4, construction=construction, epoch=epoch)
    for field in dataclasses.fields(uniform):
        a, b = getattr(uniform, field.name), getattr(equal, field.name)
        if field.name == "chunk_of":
            assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
        else:
            assert a == b, field.name
    assert equal.holders == 2 and equal.capacity == (0.5,) * 4


def test_stats_report_the_holders_per_unit():
    stats = mask_stats(_mixed([1, 0.75, 0.5, 0.5], sizes=[8, 8], kinds=["ffn", "ffn"]), [1, 1])
    assert stats["holders_per_unit"] is None
    assert (stats["holders_min"], stats["holders_mean"], stats["holders_max"]) == (2, 2.75, 3)
    assert stats["capacity"] == [1, 0.75, 0.5, 0.5] and stats["coverage_target"] == 0.6875
    assert stats["coverage_per_worker"] == [1.0, 0.75, 0.5, 0.5]


@pytest.mark.parametrize(
    "capacity,kw,message",
    [
        (
            [0.5, 0.25, 0.125],
            {},
            "masking.capacity=[0.5, 0.25, 0.125]: sums to 0.875, below 1: some unit would have no holder; capacities "
            "summing to 1 or more would work (each unit then has about their sum in holders), for example "
            "[0.572,0.286,0.143]",
        ),
        (
            [1, 1, 0.25, 0.5],
            {},
            "masking.capacity=[1, 1, 0.25, 0.5]: gives worker 2 a share of 0.25 x 2 = 0.5 units of g1, less than "
            "one; every capacity must be at least 1/2 = 0.5 with this model",
        ),
        (
            [1, 1, 0.5, 0.5],
            {"construction": "random"},
            "masking.construction='random': draws r holders per unit, which workers of different capacities "
            "(masking.capacity) cannot give; allowed with a capacity list: cyclic",
        ),
    ],
)
def test_a_capacity_list_the_units_cannot_meet_is_refused(capacity, kw, message):
    with pytest.raises(ConfigError) as info:
        _mixed(capacity, **kw)
    assert str(info.value) == message


def test_too_few_blocks_for_a_small_share_is_refused():
    with pytest.raises(ConfigError) as info:
        _mixed([1, 1, 0.1], sizes=[1] * 4, kinds=["block"] * 4)
    assert str(info.value) == (
        "masking.capacity=[1, 1, 0.1]: gives worker 2 a share of 0.1 of the blocks' parameters, less than the "
        "largest block (g0: 0.25 of them), which every worker must be able to hold; every capacity must be at "
        "least 0.25 with this model's 4 blocks, or use masking.granularity=neuron"
    )


def test_blocks_of_different_sizes_are_shared_by_parameters():
    # Stages of 1, 1, 4, 4, 16 and 16 (the shape of a ResNet's or a Swin's): by count, the worker
    # with a quarter could hold 2 of 6 blocks; by parameters, a quarter of the 42.
    numels = [1, 1, 4, 4, 16, 16]
    for capacity in ([1, 0.5, 0.5], [1, 1, 0.5, 0.5], [0.75, 0.75, 0.5]):
        mask = _mixed(capacity, sizes=[1] * 6, kinds=["block"] * 6, unit_numels=numels)
        for w, c in enumerate(capacity):
            held = sum(numels[g] for g in range(6) if mask.held_units(w, g).size)
            assert abs(held - c * 42) <= 16, (capacity, w, held)  # within one block
        counts = [mask.holder_counts(g)[0] for g in range(6)]
        assert set(counts) <= {math.floor(sum(capacity)), math.ceil(sum(capacity))}
    with pytest.raises(ConfigError, match=r"largest block \(g4: 0.381 of them\)"):
        _mixed([1, 1, 0.25, 0.25], sizes=[1] * 6, kinds=["block"] * 6, unit_numels=numels)


def test_a_list_of_the_wrong_length_is_refused_with_k():
    model = build_on_meta(tiny_model_cfg("llama"))
    masking = MaskingConfig(name="forward", capacity=[1, 1, 0.5, 0.5])
    with pytest.raises(ConfigError) as info:
        SubnetPlan.build(model, masking, family="llama", workers=2)
    assert str(info.value) == (
        "masking.capacity=[1, 1, 0.5, 0.5]: has 4 entries for K=2 SDP workers (the world size); give one capacity "
        "per worker (a resume on another world size needs the list for the new K), for example "
        "masking.capacity=[1,1]"
    )
    with pytest.raises(ConfigError, match=r"for K=2 SDP workers \(the world size / parallelism.fsdp_degree=2\)"):
        SubnetPlan.build(model, masking, family="llama", workers=2, fsdp_degree=2)


LLAMA = ["model=llama_tiny", "dataset=synthetic_text"]


def test_the_capacities_mean_is_the_runs_coverage():
    cfg = typed_config([*LLAMA, "masking=forward", "masking.capacity=[1,1,0.5,0.5]", "trainer.protocol=flop_matched"])
    assert cfg.masking.coverage == 0.75 and cfg.record["masking"]["coverage"] == 0.75
    assert cfg.record["masking"]["capacity"] == [1, 1, 0.5, 0.5]
    base = typed_config([*LLAMA, "trainer.protocol=flop_matched"]).trainer.max_steps
    assert cfg.trainer.max_steps == round(base / 0.75)  # the flop-matched protocol divides by the mean
    same = typed_config([*LLAMA, "masking=forward", "masking.capacity=[1,1,0.5,0.5]", "masking.coverage=0.75"])
    assert same.masking.coverage == 0.75


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["masking=forward", "masking.capacity=[1,1,0.5,0.5]", "masking.coverage=0.5"],
            "masking.coverage='0.5': contradicts masking.capacity=[1.0, 1.0, 0.5, 0.5], whose mean 0.75 is the "
            "run's coverage; give one of the two",
        ),
        (
            ["masking=none", "masking.capacity=[1,1]"],
            "masking.capacity=[1.0, 1.0]: applies only to SDP (masking=backward|forward; here none)",
        ),
        (
            ["masking=backward", "masking.capacity=[1,1.5]"],
            "masking.capacity=[1.0, 1.5]: has 1.5: each worker's share of the units must be in (0, 1]",
        ),
        (
            ["masking=backward", "masking.capacity=[[1],[1]]"],
            "masking.capacity[0]=[1]: must be a number",  # every typed list's items are checked alike
        ),
        (
            ["masking=backward", "masking.capacity=[1,x]"],
            "masking.capacity[1]='x': invalid: Value 'x' of type 'str' could not be converted to Float",
        ),
        (
            ["masking=backward", "masking.capacity=[1,nan]"],
            "masking.capacity[1]=nan: must be a finite number",
        ),
        (
            ["masking=backward", "masking.capacity=[]"],
            "masking.capacity=[]: must list one capacity per worker, each in (0, 1]",
        ),
        (
            ["masking=forward", "masking.capacity=[1,1,0.5]"],
            "masking.capacity=[1.0, 1.0, 0.5]: has 3 entries for K=4 SDP workers (the world size); give one "
            "capacity per worker (a resume on another world size needs the list for the new K), for example "
            "masking.capacity=[1,1,0.5,0.5]",
        ),
    ],
)
def test_capacity_config_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config([*LLAMA, *overrides], world_size=4, offline=True, check_data=False)
    assert str(info.value) == message
