"""The planner's search: structures composed as the entrypoint composes them, grouped in families."""

import pytest
from conftest import estimator_config

from sdp.errors import ConfigError
from sdp.planning.search import Composer, families
from sdp.planning.space import Structure, structures

TINY = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=64", "trainer.global_batch_size=16"]


@pytest.mark.parametrize("protocol", ["same_iteration", "flop_matched"])
def test_a_composed_copy_is_the_config_the_entrypoint_loads(protocol):
    # Every structure kind on mixed GPUs (capacities, SDP x FSDP, block and neuron, both modes),
    # as a copy of one composed base per (masking, parallelism), against load_config of its
    # overrides: equal configs, or the same one-line refusal.
    overrides = [*TINY, f"trainer.protocol={protocol}", "trainer.max_steps=40", "optim.warmup_steps=8"]
    space = structures([80.0, 80.0, 24.0, 24.0], min_coverage=0.25, granularities=("neuron", "block"))
    compose, checked, refused = Composer(overrides, world=4), 0, 0
    for s in space[: len(space) // 6] + space[-5:]:  # one precision x checkpointing, and bf16 + full AC
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
        checked += 1
    assert (checked, refused) == (26, 7)
    sdp = compose(Structure(masking="forward", coverage=0.5))
    assert sdp.trainer.max_steps == (80 if protocol == "flop_matched" else 40) and sdp.optim.warmup_steps in (8, 16)


def test_families_share_all_but_coverage_and_checkpointing():
    space = structures([80.0] * 4, min_coverage=0.25, granularities=("neuron",), every=False)
    groups = families(space)
    assert sum(map(len, groups)) == len(space) and len(groups) == 2 * 5  # precision x (DDP, FSDP, 2 modes, x FSDP(2))
    forward = next(g for g in groups if (g[0].masking, g[0].fsdp_degree, g[0].precision) == ("forward", 1, "fp32"))
    assert [s.label for s in forward[:4]] == [
        "N-SDP forward C=0.75",
        "N-SDP forward C=0.75 + AC(sel)",
        "N-SDP forward C=0.75 + AC",
        "N-SDP forward C=0.5",
    ]
    assert len(groups[0]) >= len(groups[-1])  # the longest tasks first
