"""Outer algorithms are found by outer.name in one registry (sdp.outer.algorithms): the run, the
estimator and the tables ask it, and none names an algorithm."""

from dataclasses import dataclass

import pytest

from sdp.analysis.tables import variant_label
from sdp.errors import ConfigError
from sdp.outer import OuterConfig, validate_outer
from sdp.outer.algorithms import ALGORITHMS, OuterAlgorithm, algorithm_of, outer_label, register
from sdp.outer.diloco import DiLoCo, DiLoCoConfig
from sdp.rundir import Summary


@dataclass
class StepwiseConfig(OuterConfig):
    width: int = 2


class Stepwise(OuterAlgorithm):
    """An algorithm of a test's own: a label, a knob and a check of its own."""

    name, title, schema = "stepwise", "Stepwise", StepwiseConfig

    def validate(self, cfg) -> None:
        if cfg.sync_every > 8:
            raise ConfigError("outer.sync_every", cfg.sync_every, "must be <= 8 for stepwise")
        if cfg.width < 1:
            raise ConfigError("outer.width", cfg.width, "must be >= 1")


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
        validate_outer(StepwiseConfig(name="stepwise", sync_every=16))
    validate_outer(StepwiseConfig(name="stepwise", sync_every=4))


def test_diloco_is_the_registered_one_and_its_checks_are_its_own():
    assert isinstance(algorithm_of("diloco"), DiLoCo) and outer_label("diloco", sync_every=10) == " + DiLoCo(H=10)"
    with pytest.raises(ConfigError) as err:
        validate_outer(DiLoCoConfig(name="diloco", sync_every=10, fragments=3))
    assert str(err.value) == (
        "outer.fragments=3: must divide outer.sync_every=10: fragment p syncs every H steps, H / P steps after "
        "fragment p - 1"
    )


def test_an_unknown_or_second_algorithm_of_a_name_is_refused(stepwise):
    with pytest.raises(ConfigError, match=r"outer.name='sparse': allowed: none, diloco, sparseloco, stepwise"):
        algorithm_of("sparse")
    with pytest.raises(ValueError, match="'stepwise' is registered already"):
        register(Stepwise())


def test_outer_name_is_any_registered_algorithm_and_its_schema_and_checks_are_its_own(stepwise):
    from sdp.run.config import load_config

    base = ["model=llama_tiny", "dataset=synthetic_text", "outer.name=stepwise"]

    def load(*extra):
        return load_config([*base, *extra], world_size=2, offline=True, check_data=False)

    with pytest.raises(ConfigError) as err:
        load("+outer.sync_every=16")
    assert str(err.value) == "outer.sync_every=16: must be <= 8 for stepwise"
    with pytest.raises(ConfigError) as err:
        load("+outer.sync_every=4", "+outer.width=0")
    assert str(err.value) == "outer.width=0: must be >= 1"
    with pytest.raises(ConfigError, match=r"^outer.width='x': invalid: "):
        load("+outer.sync_every=4", "+outer.width=x")
    cfg = load("+outer.sync_every=4", "+outer.width=3")
    got = (type(cfg.outer), cfg.outer.name, cfg.outer.width, cfg.outer.sync_every)
    assert got == (StepwiseConfig, "stepwise", 3, 4)
    # DiLoCo's knobs are not stepwise's: its schema refuses them.
    with pytest.raises(ConfigError, match=r"^outer.lr=0.7: invalid: "):
        load("outer=diloco", "outer.name=stepwise")
    assert type(load("outer=diloco", "outer.name=diloco").outer) is DiLoCoConfig


def test_the_outer_state_is_read_from_every_ranks_share_and_from_checkpoints_before_the_registry():
    import torch

    from sdp.run.resume import _outer_state

    a, b, c = torch.ones(2), torch.zeros(3), torch.full((1,), 2.0)
    new = [{"outer": {"state": {"momentum/x": a}}}, {"outer": {"state": {"error_feedback/y": b}}}]
    assert _outer_state(new) == {"momentum/x": a, "error_feedback/y": b}
    old = [{"outer": {"momentum": {"x": a}}}, {"outer": {"momentum": {"y": c}}}]  # DiLoCo's, by bare name
    assert _outer_state(old) == {"momentum/x": a, "momentum/y": c}
