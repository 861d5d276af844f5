"""The planner's estimate from two short traces: a LLaMA's figures are affine in its depth."""

import pytest
from conftest import estimator_config

from sdp.planning.estimator import estimate
from sdp.planning.layered import HEAD, SHORT, extended, extends, layer_spread, layered_estimate, with_layers
from sdp.planning.ranks import busiest_rank

TINY = [
    "model=llama_tiny",
    "model.num_layers=6",
    "model.num_kv_heads=4",  # 4 head units: every layer holds as many (see layer_spread)
    "dataset=synthetic_text",
    "dataset.seq_len=64",
    "trainer.global_batch_size=16",
]
SLOW = pytest.mark.slow  # make test-fast keeps one case of each family below


@pytest.mark.parametrize(
    "overrides,rank",
    [
        ([], 0),
        pytest.param(
            ["parallelism=fsdp", "parallelism.mixed_precision=bf16", "parallelism.activation_checkpointing=selective"],
            1,
            marks=SLOW,
        ),
        pytest.param(["masking=backward", "masking.coverage=0.5"], 3, marks=SLOW),
        pytest.param(
            ["masking=forward", "masking.capacity=[1,1,0.5,0.5]", "parallelism.activation_checkpointing=full"],
            3,
            marks=SLOW,
        ),
        pytest.param(
            ["masking=forward", "masking.coverage=0.5", "parallelism=fsdp", "parallelism.fsdp_degree=2"], 2, marks=SLOW
        ),
    ],
)
def test_two_short_traces_give_the_whole_traces_figures(overrides, rank):
    cfg = estimator_config([*TINY, *overrides], 4)
    assert extends(cfg) and cfg.model.num_layers == 6
    whole, line = estimate(cfg, world_size=4, rank=rank), layered_estimate(cfg, world_size=4, rank=rank)
    assert line.method == "layers 3 and 4, extended to 6"
    for key in ("params_bytes", "grads_bytes", "optim_bytes", "peak_bytes", "comm_groups"):
        assert line.memory[key] == whole.memory[key], key
    assert line.memory["peak_breakdown"] == whole.memory["peak_breakdown"]
    assert line.n_params == whole.n_params and line.flops_per_step == whole.flops_per_step
    # Backward masking's senders turn from layer to layer: a rank's bytes sent are close, not equal.
    assert line.comm_bytes_per_step == pytest.approx(whole.comm_bytes_per_step, rel=0.02)


@pytest.mark.parametrize(
    "overrides,rank",
    [
        (["parallelism.mixed_precision=bf16"], 0),
        pytest.param(["masking=forward", "masking.coverage=0.5", "outer.backup_device=device"], 1, marks=SLOW),
        pytest.param(["masking=backward", "masking.coverage=0.5"], 2, marks=SLOW),
    ],
)
def test_an_outer_loops_state_and_sync_are_on_the_line_too(overrides, rank):
    cfg = estimator_config([*TINY, "outer=diloco", "outer.sync_every=10", *overrides], 4)
    whole, line = estimate(cfg, world_size=4, rank=rank), layered_estimate(cfg, world_size=4, rank=rank)
    assert line.method == "layers 3 and 4, extended to 6"
    for key in ("outer_backup_bytes", "outer_momentum_bytes", "sync_peak_bytes", "peak_bytes"):
        assert line.memory[key] == whole.memory[key], key
    assert whole.memory["sync_peak_bytes"] > whole.memory["params_bytes"]  # not a 4-layer figure
    # A sync's bytes: exact but where backward masking's senders turn from layer to layer.
    sent, expected = line.outer["bytes_per_sync"], whole.outer["bytes_per_sync"]
    assert sent.keys() == expected.keys() and sent["outer_sync"] == expected["outer_sync"]
    assert sum(sent.values()) == pytest.approx(sum(expected.values()), rel=0.02)


@pytest.mark.slow  # end to end; make test runs it, make test-fast leaves it (docs/testing.md)
def test_each_segment_of_the_step_is_extended_on_its_own():
    # Backward masking under full AC: at 3 and 4 layers the step peaks while clipping (a float64
    # copy of the LM head's gradient), at 12 after the step, where the weight refresh's receive
    # buffers (every layer's) are issued. The line through the short traces' peaks misses it.
    overrides = ["masking=backward", "masking.coverage=0.75", "parallelism.activation_checkpointing=full"]
    cfg = estimator_config([*TINY, "model.num_layers=12", *overrides, "parallelism.mixed_precision=bf16"], 4)
    whole = estimate(cfg, world_size=4, rank=0, head=HEAD)
    one, two = (estimate(with_layers(cfg, n), world_size=4, rank=0, head=HEAD) for n in SHORT)
    line = extended(one, two, 12 - SHORT[0])  # layered_estimate's line (the test above)
    assert line.memory["peak_breakdown"] == whole.memory["peak_breakdown"]
    assert line.peak_segments == whole.peak_segments and "0 head backward" in whole.peak_segments
    three, four = one.memory["peak_bytes"], two.memory["peak_bytes"]
    assert three + 9 * (four - three) < 0.97 * whole.memory["peak_bytes"]


def test_the_weight_refreshs_buffers_are_on_the_line_for_a_sender():
    # After the step every rank issues every refresh bucket; a sender packs its own into one
    # buffer. Packing them by concatenating strided pieces made a copy of each piece alive at
    # once: a bump of one bucket at some depths, which the line multiplied (llama_1b, capacities
    # [1]*4 + [0.25]*4, full AC, bf16: rank 4's line was 1.33% over its whole trace).
    overrides = ["masking=backward", "masking.capacity=[1,0.5,0.5,0.25]", "parallelism.activation_checkpointing=full"]
    cfg = estimator_config([*TINY, "model.num_layers=8", *overrides, "parallelism.mixed_precision=bf16"], 4)
    whole = estimate(cfg, world_size=4, rank=0, head=HEAD)
    one, two = (estimate(with_layers(cfg, n), world_size=4, rank=0, head=HEAD) for n in SHORT)
    line = extended(one, two, 8 - SHORT[0])
    assert line.peak_segments["after step"] == whole.peak_segments["after step"]


@pytest.mark.parametrize(
    "overrides",
    [
        ["masking.coverage=0.5"],
        ["masking.coverage=0.75", "parallelism.activation_checkpointing=full", "parallelism.mixed_precision=bf16"],
    ],
)
def test_forward_block_sdp_is_a_line_in_the_blocks_a_rank_holds(overrides):
    block = ["masking=forward", "masking.granularity=block"]
    cfg = estimator_config([*TINY, "model.num_layers=12", *block, *overrides], 4)
    rank = busiest_rank(cfg, world_size=4)
    whole, line = estimate(cfg, world_size=4, rank=rank, head=HEAD), layered_estimate(cfg, world_size=4, rank=rank)
    assert line.method.endswith(" layers, extended in held blocks")
    assert line.memory == whole.memory  # static bytes, each kind at the peak, the communicators
    assert line.peak_segments == whole.peak_segments
    for key in ("rank", "n_params", "flops_per_step", "comm_bytes_per_step", "comm_bytes_per_step_by_kind"):
        assert getattr(line, key) == getattr(whole, key), key


def test_a_mask_that_holds_more_in_some_layers_is_traced_whole():
    # 2 head units in 4 chunks: worker 0 holds 2 heads of one layer, 1 of the next.
    cfg = estimator_config([*TINY, "model.num_kv_heads=2", "masking=forward", "masking.coverage=0.75"], 4)
    assert layer_spread(cfg, world_size=4, rank=0) == pytest.approx(1 / 9)  # 9 heads held, the line 8
    assert layered_estimate(cfg, world_size=4, rank=0).method == "traced"


@pytest.mark.parametrize(
    "overrides",
    [
        ["masking=forward", "masking.granularity=block", "masking.coverage=0.5"],
        ["model.num_layers=4"],
        ["outer=diloco", "outer.sync_every=10", "outer.fragments=2"],  # the largest fragment is no line
    ],
)
def test_what_the_line_cannot_carry_is_traced_whole(overrides):
    cfg = estimator_config([*TINY, *overrides], 4)
    assert not extends(cfg)
    assert layered_estimate(cfg, world_size=4, rank=0).method == "traced"


def test_models_of_unequal_layers_are_traced_whole():
    cfg = estimator_config(["model=resnet_tiny", "dataset=synthetic_image", "trainer.global_batch_size=8"], 2)
    assert not extends(cfg)
