"""Outer algorithms are found by outer.name in one registry (sdp.outer.algorithms): the run, the
estimator and the tables ask it, and none names an algorithm."""

import pytest

from sdp.analysis.tables import variant_label
from sdp.errors import ConfigError
from sdp.outer import OuterConfig, validate_outer
from sdp.outer.algorithms import ALGORITHMS, DiLoCo, OuterAlgorithm, algorithm_of, outer_label, register
from sdp.rundir import Summary


class Stepwise(OuterAlgorithm):
    """An algorithm of a test's own: a label and a check of its own."""

    name, title = "stepwise", "Stepwise"

    def validate(self, cfg) -> None:
        if cfg.sync_every > 8:
            raise ConfigError("outer.sync_every", cfg.sync_every, "must be <= 8 for stepwise")


@pytest.fixture
def stepwise(monkeypatch):
    monkeypatch.setitem(ALGORITHMS, "stepwise", Stepwise())
    return ALGORITHMS["stepwise"]


def test_a_registered_algorithm_names_its_rows_and_checks_its_knobs(stepwise):
    assert algorithm_of("stepwise") is stepwise and algorithm_of("none") is None
    assert outer_label("stepwise", sync_every=4) == " + Stepwise(H=4)"
    head = dict(status="completed", model="m", dataset="d", world_size=4, coverage=1.0, protocol="same_iteration",
                device="cpu", seed=0, activation_checkpointing="none", mixed_precision="fp32", masking="none",
                parallelism="ddp")  # fmt: skip
    summary = Summary.from_json({**head, "outer": {"name": "stepwise", "sync_every": 4, "fragments": 2}})
    assert variant_label(summary) == "DDP + Stepwise(H=4, P=2)"
    with pytest.raises(ConfigError, match="must be <= 8 for stepwise"):
        validate_outer(OuterConfig(name="stepwise", sync_every=16))
    validate_outer(OuterConfig(name="stepwise", sync_every=4))


def test_diloco_is_the_registered_one_and_its_checks_are_its_own():
    assert isinstance(algorithm_of("diloco"), DiLoCo) and outer_label("diloco", sync_every=10) == " + DiLoCo(H=10)"
    with pytest.raises(ConfigError) as err:
        validate_outer(OuterConfig(name="diloco", sync_every=10, fragments=3))
    assert str(err.value) == (
        "outer.fragments=3: must divide outer.sync_every=10: fragment p syncs every H steps, H / P steps after "
        "fragment p - 1"
    )


def test_an_unknown_or_second_algorithm_of_a_name_is_refused(stepwise):
    with pytest.raises(ConfigError, match=r"outer.name='sparse': allowed: none, diloco, stepwise"):
        algorithm_of("sparse")
    with pytest.raises(ValueError, match="'stepwise' is registered already"):
        register(Stepwise())


def test_outer_name_is_any_registered_algorithm_and_its_config_is_checked_by_it(stepwise):
    from sdp.run.config import load_config

    # Its knobs are DiLoCo's for now (one OuterConfig; a schema per algorithm is the next part).
    base = ["model=llama_tiny", "dataset=synthetic_text", "outer=diloco", "outer.name=stepwise"]
    with pytest.raises(ConfigError) as err:
        load_config([*base, "outer.sync_every=16"], world_size=2, offline=True, check_data=False)
    assert str(err.value) == "outer.sync_every=16: must be <= 8 for stepwise"
    cfg = load_config([*base, "outer.sync_every=4"], world_size=2, offline=True, check_data=False)
    assert cfg.outer.name == "stepwise"
