"""Process groups: which ranks pay which communicators, counted before launch."""

import functools

import pytest
import torch
from conftest import estimator_config

from sdp.errors import ConfigError
from sdp.models import build_model
from sdp.planning.estimator import estimate
from sdp.run.config import typed_config
from sdp.subnet import MaskingConfig
from sdp.subnet.groups import joined, rank_sets
from sdp.subnet.mask import build_mask
from sdp.subnet.plan import planned_comm_groups

TINY = ["model=llama_tiny", "dataset=synthetic_text", "trainer.global_batch_size=16"]


@pytest.fixture(scope="module")
def llama_1b():
    with torch.device("meta"):
        return build_model(typed_config(["model=llama_1b", "dataset=synthetic_text"]).model)


@pytest.mark.parametrize(
    "granularity,construction,workers,coverage,busiest",
    [
        # Each rank: the world plus the groups of the holder sets it is in.
        ("neuron", "cyclic", 8, 0.5, 1 + 4),  # K windows of r = 4 workers; each worker is in r of them
        ("neuron", "random", 8, 0.5, 1 + 35),  # all C(8, 4) = 70 sets appear; each worker is in 35
        ("neuron", "random", 16, 0.25, 1 + 165),
        ("neuron", "cyclic", 16, 0.25, 1 + 4),
        ("neuron", "cyclic", 32, 0.5, 1 + 16),  # cyclic grows with r = C x K too
        ("block", "cyclic", 8, 0.5, 1 + 4),
        ("block", "random", 8, 0.5, 1 + 13),  # 16 layers: 16 holder sets at most (none for empty chunks)
    ],
)
def test_llama_1b_groups_per_rank(llama_1b, granularity, construction, workers, coverage, busiest):
    cfg = MaskingConfig(name="forward", granularity=granularity, coverage=coverage, construction=construction)
    assert max(planned_comm_groups(llama_1b, cfg, family="llama", workers=workers)) == busiest


@pytest.mark.parametrize(
    "granularity,capacity,per_rank",
    [
        # Four 80 GB and four 24 GB cards: every unit has 6 holders, in one of two sets.
        ("neuron", [1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5], [3, 3, 3, 3, 2, 2, 2, 2]),
        ("block", [1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5], [3, 3, 3, 3, 2, 2, 2, 2]),
        # 4 or 5 holders: the overlaps of the arcs are five sets.
        ("neuron", [0.8, 0.8, 0.8, 0.8, 0.4, 0.4, 0.4, 0.4], [5, 5, 5, 5, 3, 3, 3, 3]),
    ],
)
def test_llama_1b_groups_per_rank_with_capacities(llama_1b, granularity, capacity, per_rank):
    cfg = MaskingConfig(name="forward", granularity=granularity, capacity=capacity)
    assert planned_comm_groups(llama_1b, cfg, family="llama", workers=8) == per_rank


def test_empty_chunks_of_block_masks_need_no_group():
    # A block group is one unit: of its K chunks only one holds it.
    mask = build_mask([1, 1], num_workers=4, coverage=0.5)
    # Block 0 in chunk 0 (held by workers 3 and 0), block 1 in chunk 1 (workers 0 and 1); the
    # other chunks' holder sets, (1, 2) and (2, 3), hold nothing.
    assert mask.holder_sets() == [(0, 1), (0, 3)]


def test_sdp_x_fsdp_rank_sets_are_per_shard_plus_replicated():
    sets = rank_sets([(0, 1)], fsdp_degree=2, replicated=True)
    assert sets == [(0, 2), (1, 3), (0, 1, 2, 3)]
    assert joined(sets, rank=0, world_size=8) == 2 and joined(sets, rank=0, world_size=4) == 1  # (0..3) is WORLD


def test_resampling_a_random_mask_adds_groups(llama_1b):
    fixed = MaskingConfig(name="forward", granularity="block", coverage=0.5, construction="random")
    resampled = MaskingConfig(**{**fixed.__dict__, "resample_every": 10})
    once = max(planned_comm_groups(llama_1b, fixed, family="llama", workers=8))
    over_run = max(planned_comm_groups(llama_1b, resampled, family="llama", workers=8, steps=100))
    assert once < over_run <= 1 + 35


def test_too_many_groups_are_refused_naming_the_construction():
    with pytest.raises(ConfigError) as info:
        estimator_config([*TINY, "masking=backward", "masking.construction=random", "masking.coverage=0.5"], 8)
    assert str(info.value) == (
        "masking.construction='random': makes the busiest rank join 19 process groups (the world included) with "
        "K=8 workers at C=0.5, more than parallelism.max_comm_groups=16; each is an NCCL communicator of about "
        "688 MiB of device memory (parallelism.comm_group_overhead_mb); use masking.construction=cyclic (5 per "
        "rank here), or raise parallelism.max_comm_groups"
    )
    # The same run with cyclic masks is accepted.
    estimator_config([*TINY, "masking=backward", "masking.coverage=0.5"], 8)


def test_a_cyclic_mask_over_the_limit_suggests_fewer_holders():
    with pytest.raises(ConfigError) as info:
        estimator_config([*TINY, "masking=backward", "masking.coverage=0.5", "parallelism.max_comm_groups=2"], 4)
    assert "lower masking.coverage or use fewer workers, or raise parallelism.max_comm_groups" in str(info.value)


def test_capacities_over_the_limit_are_refused_with_a_common_share():
    # The tiny ResNet's channel circles cut at 0, 0.2, 0.4, 0.6, 0.8 by the arcs' ends: five holder sets.
    resnet = ["model=resnet_tiny", "dataset=synthetic_image", "trainer.global_batch_size=16", "masking=backward"]
    capacity = "masking.capacity=[0.8,0.8,0.8,0.8,0.4,0.4,0.4,0.4]"
    with pytest.raises(ConfigError) as info:
        estimator_config([*resnet, capacity, "parallelism.max_comm_groups=4"], 8)
    assert str(info.value) == (
        "masking.capacity=[0.8, 0.8, 0.8, 0.8, 0.4, 0.4, 0.4, 0.4]: makes the busiest rank join 5 process groups "
        "(the world included) with K=8 workers at capacities [0.8, 0.8, 0.8, 0.8, 0.4, 0.4, 0.4, 0.4], more than "
        "parallelism.max_comm_groups=4; each is an NCCL communicator of about 688 MiB of device memory "
        "(parallelism.comm_group_overhead_mb); use capacities that are multiples of a common share (of 1/m: at "
        "most m holder sets), or raise parallelism.max_comm_groups"
    )
    # Halves: two holder sets, three groups for the busiest rank.
    estimator_config([*resnet, "masking.capacity=[1,1,1,1,0.5,0.5,0.5,0.5]", "parallelism.max_comm_groups=3"], 8)


@pytest.mark.parametrize(
    "overrides,groups",
    [(["masking=none"], 1), (["masking=backward", "masking.coverage=0.5"], 3), (["parallelism=fsdp"], 1)],
)
def test_the_estimator_adds_each_communicator_to_its_peak(overrides, groups):
    est = estimate(estimator_config([*TINY, *overrides], 4), world_size=4, rank=0).memory
    assert est["comm_groups"] == groups
    assert est["comm_group_bytes"] == groups * 688 * 2**20
    assert est["peak_with_comm_groups_bytes"] == est["peak_bytes"] + est["comm_group_bytes"]


def test_a_very_long_resampled_run_is_counted_without_visiting_every_epoch(llama_1b):
    # 10^12 steps with a new random mask every step: once every set of r workers has been
    # drawn, later epochs add none, so the count stops there (it used to visit every epoch).
    cfg = MaskingConfig(name="forward", coverage=0.5, construction="random", resample_every=1)
    count = functools.partial(planned_comm_groups, llama_1b, cfg, family="llama", workers=4)
    assert count(steps=10**12) == count(steps=200) == [1 + 3] * 4  # C(4, 2) = 6 sets, 3 with each worker
