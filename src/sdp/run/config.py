"""Compose the Hydra config, convert it once to typed dataclasses, validate it.

Hydra stays here and on the command line (`sdp.launching.cli`): composition ends in one
object, the typed `RunConfig`, which also carries the record of the composed config
(`RunConfig.record`: what config.yaml holds, W&B shows and a resume compares). The rest of
the package receives that object. Every failure becomes a `ConfigError` whose one-line
message names the key, the value and what is allowed, before any process group starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib.util
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sdp.data import DataConfig, data_vocab_size, validate_data
from sdp.errors import ConfigError
from sdp.metrics.logger import LoggerConfig, validate_logger
from sdp.models import (
    FAMILIES,
    FAMILY_KIND,
    LlamaConfig,
    ModelConfig,
    SwinConfig,
    blocks,
    build_on_meta,
    validate_model,
)
from sdp.optim import OptimConfig, validate_optim
from sdp.outer import OuterConfig, validate_outer, validate_outer_with
from sdp.outer.algorithms import schema_of
from sdp.parallel import ParallelConfig, validate_parallel
from sdp.paths import CONF_DIR, DamagedFile, describe, read_yaml_mapping
from sdp.redact import redact
from sdp.run.trainer_config import TrainerConfig, validate_trainer
from sdp.subnet import (
    MaskingConfig,
    capacity_replaces_coverage,
    is_sdp,
    sdp_workers,
    validate_masking,
    validate_sdp_x_fsdp,
)
from sdp.subnet.plan import SubnetPlan, validate_plan

GROUPS = (
    "model",
    "dataset",
    "masking",
    "parallelism",
    "outer",
    "optim",
    "trainer",
    "logger",
    "experiment",
    "variant",
    "debug",
)


@dataclass
class RunConfig:
    model: ModelConfig
    dataset: DataConfig
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    parallelism: ParallelConfig = field(default_factory=ParallelConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 0
    name: str | None = None
    run_dir: str | None = None
    output_root: str = "outputs"
    # The composed config, resolved, secrets redacted and trainer.protocol applied: what
    # config.yaml holds, W&B shows and a resume compares with a checkpoint (`typed_config` fills it).
    record: dict = field(default_factory=dict, repr=False, compare=False)


SEARCHPATH = "hydra.searchpath"


def group_options(group: str, dirs: list[Path] | None = None) -> list[str]:
    """The options of a config group, as `group=<option>` accepts them, from the package's
    configs and the user's config dirs (`search_dirs`)."""
    return sorted({p.stem for d in dirs or [CONF_DIR] for p in (d / group).glob("*.yaml")})


def search_dirs(overrides: list[str]) -> list[Path]:
    """The config dirs a composition reads: the package's conf/, then each directory a
    `hydra.searchpath=[...]` override adds (file://DIR, pkg://module or a plain path;
    `--config-dir DIR` adds one); a missing one is refused."""
    dirs = [CONF_DIR]
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+~") != SEARCHPATH:
            continue
        for entry in _searchpath_entries(value):
            dirs.append(_search_dir(entry, value))
    return dirs


def _searchpath_entries(value: str) -> list[str]:
    """The entries of a hydra.searchpath value, as Hydra's override grammar reads them (a sweep
    writes them back escaped: file\\:///...)."""
    try:
        entries = OverridesParser.create().parse_override(f"{SEARCHPATH}={value}").value()
    except HydraException as err:
        raise ConfigError(SEARCHPATH, value, f"not a list of directories: {str(err).splitlines()[0]}") from None
    return [str(e) for e in (entries if isinstance(entries, list) else [entries])]


def _search_dir(entry: str, value: str) -> Path:
    if entry.startswith("pkg://"):
        spec = importlib.util.find_spec(entry.removeprefix("pkg://").replace("/", "."))
        locations = list(spec.submodule_search_locations or []) if spec else []
        if not locations:
            raise ConfigError(SEARCHPATH, value, f"{entry}: no such package")
        return Path(locations[0])
    path = Path(entry.removeprefix("file://"))
    if not path.is_dir():
        raise ConfigError(SEARCHPATH, value, f"{entry}: no such directory")
    return path


def with_config_dirs(overrides: list[str], dirs: list[str]) -> list[str]:
    """`overrides` with `dirs` (--config-dir) and any plain path of a hydra.searchpath override
    as absolute file:// entries of one hydra.searchpath override (Hydra wants a scheme; a
    sweep's jobs may start elsewhere)."""
    entries, rest = [], []
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+~") == SEARCHPATH:
            entries += _searchpath_entries(value)
        else:
            rest.append(override)
    entries += dirs
    if not entries:
        return rest
    absolute = [e if "://" in e else f"file://{Path(e).expanduser().resolve()}" for e in entries]
    return [*rest, f"{SEARCHPATH}=[{','.join(absolute)}]"]


def compose_config(overrides: list[str]) -> DictConfig:
    """Compose `conf/config.yaml` with command-line overrides (Hydra's compose API)."""
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise _explain_compose_error(err, overrides) from None


def _explain_compose_error(err: Exception, overrides: list[str]) -> ConfigError:
    msg = str(err)
    missing = re.search(r"Could not find '(\w+)/([^']+)'", msg)
    if missing:
        group, option = missing.groups()
        allowed = ", ".join(group_options(group, search_dirs(overrides)))
        return ConfigError(group, option, f"unknown option; allowed: {allowed}")
    not_in_struct = re.search(r"Could not override '([^']+)'", msg) or re.search(r"Key '([^']+)' is not in struct", msg)
    if not_in_struct:
        key = not_in_struct.group(1)
        value = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+~").split("=", 1)[0] == key), None)
        hint = _other_option_of(key, search_dirs(overrides)) or _closest_key(
            key, [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != key]
        )
        return ConfigError(key, value, f"no such key{hint} (prefix '+' to add a new one)")
    bad = _unparsable(overrides)
    if bad is not None:
        return bad
    ambiguous = re.search(r"Ambiguous value for argument '([^=']+)=([^']*)'", msg)
    if ambiguous:
        key, value = ambiguous.groups()
        sweep = "a comma list is a sweep (python -m sdp.train -m ...)"
        return ConfigError(key, value, f"{sweep}; a list value is in brackets: {key}=[{value}]")
    first_line = msg.strip().splitlines()[0] if msg.strip() else type(err).__name__
    return ConfigError("overrides", " ".join(overrides), f"could not be composed: {first_line}")


def _unparsable(overrides: list[str]) -> ConfigError | None:
    """The first override Hydra's grammar cannot read, with the hint that fixes most: the shell
    split it (a space in a value, a list with spaces) or a bracket is open; None if each reads."""
    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_override(override)
        except HydraException as err:
            key, sep, value = override.partition("=")
            hint = (
                "quote a value with spaces or brackets as one shell word, brackets closed: 'key=[a, b]', 'name=my run'"
            )
            detail = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            if not sep:
                return ConfigError("overrides", override, f"is not key=value (was a value split at a space?); {hint}")
            return ConfigError(key, value, f"cannot be parsed ({detail}); {hint}")
    return None


def _other_option_of(key: str, dirs: list[Path]) -> str:
    """'; it is a key of outer=diloco' for a key that another option of its group has (''
    if none does): outer=none has no outer.sync_every."""
    group, _, leaf = key.partition(".")
    if not leaf or "." in leaf:
        return ""
    having = [p.stem for d in dirs for p in sorted((d / group).glob("*.yaml")) if leaf in (OmegaConf.load(p) or {})]
    return f"; it is a key of {' and '.join(f'{group}={o}' for o in having)}" if having else ""


def _closest_key(key: str, overrides: list[str]) -> str:
    """', did you mean a.b?' for a mistyped dotted key, from the keys the config has there ('' if none)."""
    parent, _, last = key.rpartition(".")
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        node = OmegaConf.select(cfg, parent) if parent else cfg
    except (HydraException, OmegaConfBaseException):
        return ""
    if not isinstance(node, DictConfig):
        return ""
    close = difflib.get_close_matches(last, [str(k) for k in node.keys()], n=1)
    return f"; did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""


def check_pairing(cfg: DictConfig, dirs: list[Path] | None = None) -> None:
    """The model family must suit the dataset kind.

    Runs before interpolations are resolved: a family's fields may interpolate
    the dataset's (num_classes, image_size), which a mismatched dataset lacks.
    """
    family = cfg.model.get("family")
    if family not in FAMILIES:
        raise ConfigError("model.family", family, f"allowed: {', '.join(FAMILIES)}")
    kind = cfg.dataset.get("kind")
    if FAMILY_KIND[family] != kind:
        dirs = dirs or [CONF_DIR]
        kinds = {p.stem: OmegaConf.load(p).get("kind") for d in reversed(dirs) for p in (d / "dataset").glob("*.yaml")}
        wanted = sorted(o for o, kind in kinds.items() if kind == FAMILY_KIND[family])
        raise ConfigError(
            "dataset",
            cfg.dataset.get("name"),
            f"model={cfg.model.get('name')} needs a {FAMILY_KIND[family]} dataset; allowed: {', '.join(wanted)}",
        )


def check_variant(raw: DictConfig, overrides: list[str], dirs: list[Path]) -> None:
    """`variant=V` sets masking= (and masking.granularity); an override that changes what V
    sets would run another variant than the one asked for: refused, naming both."""
    names = [o.partition("=")[2] for o in overrides if o.lstrip("+~").startswith("variant=")]
    paths = [d / "variant" / f"{names[-1]}.yaml" for d in reversed(dirs)] if names else []
    path = next((p for p in paths if p.is_file()), None)
    if path is None:
        return
    spec = OmegaConf.to_container(OmegaConf.load(path))
    wants = {}
    for entry in spec.get("defaults") or []:
        for k, v in entry.items() if isinstance(entry, dict) else []:
            if k.replace("override", "").strip() == "/masking":
                wants["masking"] = v
    if isinstance(spec.get("masking"), dict) and "granularity" in spec["masking"]:
        wants["masking.granularity"] = spec["masking"]["granularity"]
    for key, want in wants.items():
        got = OmegaConf.select(raw, "masking.name" if key == "masking" else key)
        if str(got) != str(want):
            raise ConfigError(
                "variant", names[-1], f"sets {key}={want}, and {key}={got} contradicts it; give one of the two"
            )


def to_typed(cfg: DictConfig) -> RunConfig:
    """Convert the composed config to `RunConfig`, checking every field's type."""
    family = cfg.model.family
    sections = {
        "model": FAMILIES[family],
        "dataset": DataConfig,
        "masking": MaskingConfig,
        "parallelism": ParallelConfig,
        "outer": schema_of(cfg.outer.name),
        "optim": OptimConfig,
        "trainer": TrainerConfig,
        "logger": LoggerConfig,
    }
    typed = {}
    for key, schema in sections.items():
        try:
            _check_lists(schema, cfg[key], prefix=key)
            merged = OmegaConf.merge(OmegaConf.structured(schema), cfg[key])
            typed[key] = OmegaConf.to_object(merged)
            _check_list_items(schema, typed[key], prefix=key)
        except OmegaConfBaseException as err:
            full = getattr(err, "full_key", None)  # a list's entry: "capacity[1]", where err.key is 1
            field_name = full if isinstance(full, str) and "[" in full else getattr(err, "key", None) or "?"
            value = getattr(err, "value", None)
            if value is None and field_name in cfg[key]:
                value = cfg[key][field_name]
            choices = _choices(schema, field_name)
            if choices:  # an enum-typed choice: OmegaConf checked it against the enum
                raise ConfigError(f"{key}.{field_name}", value, f"allowed: {', '.join(choices)}") from None
            raise ConfigError(f"{key}.{field_name}", value, f"invalid: {str(err).splitlines()[0]}") from None
    top = {k: cfg.get(k) for k in ("seed", "name", "run_dir", "output_root")}
    return RunConfig(**typed, **top)


def _list_item_type(kind) -> type | None:
    """X of a `list[X]` or `list[X] | None` annotation; None for any other."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next((a for a in typing.get_args(kind) if a is not type(None)), None)
    return typing.get_args(kind)[0] if typing.get_origin(kind) is list else None


_ITEM_NAMES = {float: "a number", int: "an integer", str: "a string"}


def _check_lists(schema: type, raw: DictConfig, *, prefix: str) -> None:
    """A mapping given where a list is typed (OmegaConf's merge error names no key)."""
    for name, kind in typing.get_type_hints(schema).items():
        if _list_item_type(kind) is not None and isinstance(raw.get(name), DictConfig):
            raise ConfigError(f"{prefix}.{name}", OmegaConf.to_container(raw[name]), "must be a list")


def _check_list_items(schema: type, typed: object, *, prefix: str) -> None:
    """Every item of a typed list is of its declared type: OmegaConf lets a nested list, [[1], [2]],
    through a list[float] or list[str] (the code below then fails on it, or ships it to W&B)."""
    for name, kind in typing.get_type_hints(schema).items():
        item = _list_item_type(kind)
        for i, value in enumerate(getattr(typed, name, None) or []) if item else []:
            ok = isinstance(value, (int, float) if item is float else item) and not isinstance(value, bool)
            if not ok:
                raise ConfigError(f"{prefix}.{name}[{i}]", value, f"must be {_ITEM_NAMES.get(item, item.__name__)}")


def _choices(schema: type, field_name: str) -> list[str]:
    """The values an enum-typed field of `schema` allows ([] for other fields)."""
    kind = typing.get_type_hints(schema).get(field_name)
    return [m.value for m in kind] if isinstance(kind, type) and issubclass(kind, enum.Enum) else []


# Whole numbers go to torch, numpy and the C libraries below them as 64-bit integers.
INT64 = (-(2**63), 2**63 - 1)


def check_numbers(node, prefix: str = "") -> None:
    """Every number of a typed config (recursively, lists included) is finite and fits the C
    types it is handed to: a float NaN or infinity, or a whole number beyond 64 bits, is one
    ConfigError naming its key, whatever the key (the class, not the examples)."""
    items = (
        [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
        if dataclasses.is_dataclass(node)
        else list(enumerate(node))
    )
    for name, value in items:
        key = f"{prefix}[{name}]" if isinstance(name, int) else f"{prefix}{'.' if prefix else ''}{name}"
        if dataclasses.is_dataclass(value) or isinstance(value, list | tuple):
            check_numbers(value, key)
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(key, value, "must be a finite number")
        elif isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
            raise ConfigError(key, value, "must fit in a 64-bit integer, [-2**63, 2**63 - 1]")


def validate(cfg: RunConfig, *, world_size: int, offline: bool, check_data: bool = True) -> SubnetPlan | None:
    """Every check that can run before the process group starts (`check_data=False`: all but
    those that look at the data, for the memory estimator, which feeds shaped dummies). Returns
    SDP's plan, which the mask's checks built (the model on the meta device, its units, the mask,
    the holder sets), for the run to hand on to its strategy; None for a run without SDP."""
    if not isinstance(cfg.seed, int) or isinstance(cfg.seed, bool):
        raise ConfigError("seed", cfg.seed, "must be an integer")
    for key, seed in (("seed", cfg.seed), ("masking.seed", cfg.masking.seed)):
        # A resume on another world size re-seeds from numpy's SeedSequence([seed, ...]), which
        # takes no negative seed; torch takes none past 64 bits.
        if not 0 <= seed <= INT64[1]:
            raise ConfigError(key, seed, "must be in [0, 2**63 - 1]")
    check_numbers(cfg)
    if cfg.name is not None and not cfg.name.strip():
        raise ConfigError("name", cfg.name, "is empty: give a name, or leave name out (model-dataset-masking)")
    if cfg.name is not None and (Path(cfg.name).name != cfg.name or cfg.name in (".", "..")):
        raise ConfigError("name", cfg.name, "must be a plain name (no '/' or '..'): it names a dir under output_root")
    validate_model(cfg.model)
    validate_masking(cfg.masking)
    validate_parallel(cfg.parallelism)
    validate_sdp_x_fsdp(cfg.parallelism, masking=cfg.masking.name, world_size=world_size)
    validate_outer(cfg.outer)
    plan = None
    if is_sdp(cfg.masking.name):  # builds the model on the meta device, as below
        workers = sdp_workers(cfg.parallelism, masking=cfg.masking.name, world_size=world_size)
        steps = cfg.trainer.max_steps
        plan = validate_plan(cfg.model, cfg.masking, world_size=workers, parallel=cfg.parallelism, steps=steps)
        n_blocks = len(plan.block_paths)
    else:
        # A shape the model's library refuses: one line, before any process group.
        n_blocks = len(blocks(build_on_meta(cfg.model), family=cfg.model.family))
    validate_outer_with(
        cfg.outer,
        parallelism=cfg.parallelism.name,
        masking=cfg.masking.name,
        resample_every=cfg.masking.resample_every,
        blocks=n_blocks,
        family=cfg.model.family,
    )
    validate_optim(cfg.optim)
    validate_trainer(cfg.trainer, world_size=world_size)
    validate_logger(cfg.logger)
    if check_data:
        validate_data(cfg.dataset, offline=offline)
    if isinstance(cfg.model, LlamaConfig):
        if cfg.dataset.seq_len > cfg.model.max_seq_len:
            raise ConfigError(
                "dataset.seq_len",
                cfg.dataset.seq_len,
                f"must be <= model.max_seq_len={cfg.model.max_seq_len} (the model's positions)",
            )
        vocab = data_vocab_size(cfg.dataset) if check_data else None
        if vocab is not None and vocab > cfg.model.vocab_size:
            raise ConfigError(
                "model.vocab_size", cfg.model.vocab_size, f"must be >= the tokenizer's {vocab} ids (dataset.tokenizer)"
            )
    if isinstance(cfg.model, SwinConfig) and cfg.model.img_size != cfg.dataset.image_size:
        raise ConfigError(
            "model.img_size", cfg.model.img_size, f"must equal dataset.image_size={cfg.dataset.image_size}"
        )
    return plan


def typed_config(overrides: list[str]) -> RunConfig:
    """Compose and type a run's config, without the checks that look at data or the world."""
    dirs = search_dirs(overrides)
    raw = compose_config(overrides)
    check_pairing(raw, dirs)
    check_variant(raw, overrides, dirs)
    try:
        OmegaConf.resolve(raw)
    except OmegaConfBaseException as err:
        raise ConfigError(
            str(getattr(err, "full_key", "?")), None, f"cannot be resolved: {str(err).splitlines()[0]}"
        ) from None
    typed = to_typed(raw)
    typed.record = redact(OmegaConf.to_container(raw, resolve=True))
    apply_capacity(typed, overrides)
    apply_protocol(typed)
    return typed


def apply_capacity(cfg: RunConfig, overrides: list[str]) -> None:
    """masking.capacity replaces masking.coverage (`sdp.subnet.capacity_replaces_coverage`), in
    the record too."""
    given = [o.partition("=")[2] for o in overrides if o.partition("=")[0].lstrip("+~") == "masking.coverage"]
    capacity_replaces_coverage(cfg.masking, given_coverage=given[-1] if given else None)
    cfg.record["masking"]["coverage"] = cfg.masking.coverage


def apply_protocol(cfg: RunConfig) -> None:
    """trainer.protocol=flop_matched: an SDP run takes 1/C times the optimizer steps (and lr
    warmup) of the DDP budget in trainer.max_steps, so its total compute matches DDP's, as in
    the paper; written into the record too, so config.yaml holds the steps the run takes."""
    coverage = cfg.masking.coverage
    if cfg.trainer.protocol != "flop_matched" or not is_sdp(cfg.masking.name) or not 0 < coverage <= 1:
        return
    cfg.trainer.max_steps = round(cfg.trainer.max_steps / coverage)
    cfg.optim.warmup_steps = round(cfg.optim.warmup_steps / coverage)
    cfg.record["trainer"]["max_steps"] = cfg.trainer.max_steps
    cfg.record["optim"]["warmup_steps"] = cfg.optim.warmup_steps


def by_dotted_key(config: dict, prefix: str = "") -> dict:
    """A record's nested settings as {"a.b": value} (lists are values)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(by_dotted_key(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def record_yaml(cfg: RunConfig) -> str:
    """config.yaml: the record as YAML."""
    return OmegaConf.to_yaml(cfg.record)


def load_config(overrides: list[str], *, world_size: int, offline: bool, check_data: bool = True) -> RunConfig:
    """Compose, type and validate a run's config; raises ConfigError on any bad input."""
    typed = typed_config(overrides)
    validate(typed, world_size=world_size, offline=offline, check_data=check_data)
    return typed


def run_config(path: Path) -> RunConfig:
    """A run dir's config.yaml, typed (its record is the file); DamagedFile when it is not a
    config this version reads."""
    raw = read_yaml_mapping(path)
    try:
        typed = to_typed(OmegaConf.create(raw))
    except ConfigError as err:
        raise DamagedFile(path, f"holds a config this version refuses ({err})") from None
    except (AttributeError, KeyError, TypeError, ValueError, OmegaConfBaseException) as err:
        raise DamagedFile(path, f"is not a run's config ({describe(err)})") from None
    typed.record = raw
    return typed
