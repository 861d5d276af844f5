"""The planner's search: structures composed as the entrypoint composes them, grouped in families."""

import pytest
from conftest import estimator_config

from sdp.errors import ConfigError
from sdp.planning.estimator import estimate
from sdp.planning.fit import GIB
from sdp.planning.search import Composer, families, verify
from sdp.planning.space import Structure, structures

TINY = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=64", "trainer.global_batch_size=16"]


def test_a_composed_copy_is_the_config_the_entrypoint_loads():
    # Every structure kind on mixed GPUs (capacities, SDP x FSDP, block and neuron, both modes),
    # as a copy of one composed base per (masking, parallelism), against load_config of its
    # overrides: equal configs, or the same one-line refusal.
    overrides = [*TINY, "trainer.protocol=flop_matched", "trainer.max_steps=40", "optim.warmup_steps=8"]
    space = structures([80.0, 80.0, 24.0, 24.0], min_coverage=0.25, granularities=("neuron", "block"))
    compose, checked, refused = Composer(overrides, world=4), 0, 0
    sample = [s for s in space if (s.precision, s.checkpointing) in (("fp32", "none"), ("bf16", "full"))]
    for s in sample:  # every kind of structure (SDP x FSDP in bf16), with and without checkpointing
        try:
            expected = estimator_config([*overrides, *s.overrides()], 4)
        except ConfigError as err:
            with pytest.raises(ConfigError) as info:
                compose(s)
            assert str(info.value) == str(err)
            refused += 1
            continue
        got = compose(s)
        assert got == expected, s.label
        assert got.record == expected.record, s.label  # what config.yaml and W&B would show
        checked += 1
    assert (checked, refused) == (40, 14)
    # The protocol scales the steps from the budget, once (SDP at C = 0.5: twice DDP's steps).
    sdp, ddp = compose(Structure(masking="forward", coverage=0.5)), compose(Structure())
    assert (sdp.trainer.max_steps, sdp.optim.warmup_steps, ddp.trainer.max_steps) == (80, 16, 40)
    forward = Structure(masking="forward", coverage=0.5)
    plain = Composer([*TINY, "trainer.max_steps=40"], world=4)(forward)  # same_iteration: the budget itself
    assert plain == estimator_config([*TINY, "trainer.max_steps=40", *forward.overrides()], 4)


def test_families_share_all_but_coverage_and_checkpointing():
    space = structures([80.0] * 4, min_coverage=0.25, granularities=("neuron",), every=False)
    groups = families(space)
    # fp32: DDP, FSDP, 2 modes; bf16 adds SDP x FSDP(2)
    assert sum(map(len, groups)) == len(space) and len(groups) == 4 + 5
    forward = next(g for g in groups if (g[0].masking, g[0].fsdp_degree, g[0].precision) == ("forward", 1, "fp32"))
    assert [s.label for s in forward[:4]] == [
        "N-SDP forward C=0.75",
        "N-SDP forward C=0.75 + AC(sel)",
        "N-SDP forward C=0.75 + AC",
        "N-SDP forward C=0.5",
    ]
    assert len(groups[0]) >= len(groups[-1])  # the longest tasks first


def test_verify_puts_whole_traces_in_place_of_the_lines_peaks():
    # 8 samples a rank at micro-batch 2: 4 accumulation steps, traced whole as 2 (the same peak).
    cfg = estimator_config([*TINY, "model.num_layers=6", "trainer.grad_accum_steps=4"], 2)
    row = {"run": "DDP", "micro_batch": 2, "peaks_bytes": {"0": 1}, "method": "layers 3 and 4, extended to 6"}
    whole = estimate(cfg, world_size=2, rank=0)["memory"]["peak_with_comm_groups_bytes"]
    out = verify(row, cfg, devices=[80.0, 80.0])
    assert out["peaks_bytes"] == {0: whole} and out["line_peaks_bytes"] == {"0": 1} and out["fits"]
    assert out["method"] == "traced whole (verified)"
    tight = verify(row, cfg, devices=[whole / GIB / 1.01] * 2)  # 1% too small
    assert not tight["fits"] and tight["headroom"] == pytest.approx(-0.01, abs=1e-4)
