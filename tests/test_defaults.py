"""Defaults defined once: the dataclasses (what code and tests construct) and the YAML of each
group's default option (what a run composes) hold the same defaults, field for field."""

import dataclasses
import enum
import typing

import pytest
from omegaconf import OmegaConf

from sdp.errors import ConfigError
from sdp.metrics.logger import LoggerConfig
from sdp.models import LlamaConfig
from sdp.optim import OptimConfig
from sdp.parallel import ParallelConfig
from sdp.run.config import CONF_DIR, typed_config
from sdp.run.trainer_config import TrainerConfig
from sdp.subnet import MaskingConfig

SCHEMAS = {"trainer": TrainerConfig, "parallelism": ParallelConfig, "masking": MaskingConfig, "optim": OptimConfig}
SCHEMAS["logger"] = LoggerConfig


def default_options() -> dict[str, str]:
    """group -> the option conf/config.yaml's defaults list picks."""
    listed = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"))["defaults"]
    return {k: v for entry in listed if isinstance(entry, dict) for k, v in entry.items()}


def field_defaults(schema) -> dict:
    out = {}
    for f in dataclasses.fields(schema):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


# Fields a group's default option leaves out on purpose (so an override of them is refused there).
LEFT_OUT = {"optim": {"momentum", "nesterov"}}  # SGD's: adamw.yaml has none


def differences(schema, yaml: dict, left_out: set[str] = frozenset()) -> list[str]:
    """Where a group's default YAML and its dataclass disagree: a field missing from the YAML,
    a key that is no field, a value that differs."""
    fields = field_defaults(schema)
    out = [f"{k}: not in the YAML" for k in fields if k not in yaml and k not in left_out]
    out += [f"{k}: no such field" for k in yaml if k not in fields]
    out += [
        f"{k}: {yaml[k]!r} in the YAML, {fields[k]!r} in the dataclass"
        for k in yaml
        if yaml[k] != fields.get(k, yaml[k])
    ]
    return out


@pytest.mark.parametrize("group", sorted(SCHEMAS))
def test_the_default_option_of_each_group_is_its_dataclass(group):
    option = default_options()[group]
    yaml = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{option}.yaml"))
    yaml.pop("defaults", None)
    assert differences(SCHEMAS[group], yaml, LEFT_OUT.get(group, set())) == []


def test_a_difference_is_found():
    yaml = {**field_defaults(TrainerConfig), "log_every": 7, "typo": 1}
    del yaml["max_steps"]
    assert differences(TrainerConfig, yaml) == [
        "max_steps: not in the YAML",
        "typo: no such field",
        "log_every: 7 in the YAML, 10 in the dataclass",
    ]


def enum_fields() -> list[tuple[str, str, list[str]]]:
    """(group, field, the values it allows) of every enum-typed choice of the groups' schemas."""
    out = []
    for group, schema in sorted({**SCHEMAS, "model": LlamaConfig}.items()):
        for name, kind in typing.get_type_hints(schema).items():
            if isinstance(kind, type) and issubclass(kind, enum.Enum):
                out.append((group, name, [m.value for m in kind]))
    return out


def test_the_choices_are_enums():
    found = {f"{g}.{f}" for g, f, _ in enum_fields()}
    # masking.name and outer.name are strings their registries check (tests/test_masking_modes.py,
    # tests/test_outer_registry.py), not enums: a mode or an algorithm may be added.
    assert found >= {"trainer.protocol", "trainer.on_nonfinite", "masking.granularity",
                     "parallelism.mixed_precision", "optim.schedule", "logger.mode", "model.loss"}  # fmt: skip
    assert "masking.name" not in found and "outer.name" not in found


@pytest.mark.parametrize("group,field,allowed", enum_fields(), ids=lambda v: v if isinstance(v, str) else None)
def test_omegaconf_refuses_a_value_outside_a_choice_with_what_is_allowed(group, field, allowed):
    extra = ["model=llama_tiny", "dataset=synthetic_text"] if group == "model" else []
    with pytest.raises(ConfigError) as info:
        typed_config([*extra, f"{group}.{field}=bogus"])
    assert str(info.value) == f"{group}.{field}='bogus': allowed: {', '.join(allowed)}"
    cfg = typed_config(extra)
    assert getattr(getattr(cfg, group), field) in allowed  # the typed config holds the enum member
