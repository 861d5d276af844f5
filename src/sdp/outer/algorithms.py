"""Outer algorithms as plug-ins: one object per `outer.name`, found in `ALGORITHMS`.

An algorithm owns what differs between methods that take local steps and sync now and then:
its config schema (`schema`, a dataclass extending `OuterConfig`) and the checks on it
(`validate`), its name in tables, plans and estimates (`label`), and the loop that runs its syncs
over a strategy's `OuterView` (`build`: a `sdp.outer.loop.OuterLoop`, which holds theta_prev, the
windows and the checkpointed state, and asks the algorithm's `OuterMethod` how the holders
exchange their pseudo-gradients and what the outer step is). The run, the estimator, the planner and the tables
ask the registry; none names an algorithm. The built-in ones register themselves in their own
modules, which `sdp.outer` imports; docs/architecture.md says how to add one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from sdp.errors import ConfigError


class BackupDevice(StrEnum):
    """outer.backup_device: where theta_prev and an algorithm's state live."""

    cpu = "cpu"
    device = "device"


@dataclass
class OuterConfig:
    """The keys every outer loop has (`outer=none`: only `name` is given). An algorithm's schema
    extends it with its own knobs."""

    name: str = "none"  # an algorithm registered here, or none
    sync_every: int = 50  # H: inner steps between two syncs of a fragment (1: every step)
    fragments: int = 1  # P: groups of consecutive blocks synced in turn (Streaming DiLoCo); 1: all at once
    backup_device: BackupDevice = BackupDevice.cpu


class OuterAlgorithm:
    """The base of an outer algorithm (see the module docstring); `name` is its `outer.name`."""

    name = ""
    title = ""  # as tables and plans name it
    caveat = ""  # the plans' word on its quality, from docs/lowcomm.md's comparison
    schema: type = OuterConfig

    def validate(self, cfg) -> None:
        """The checks on its outer.* knobs alone, one ConfigError naming the key."""

    def label(self, *, sync_every: int, fragments: int = 1, knobs: dict | None = None) -> str:
        """Its name in a row: the title, H and P, and what `details` makes of its knobs
        (`knobs`: summary.json's `outer`, or the config's; None: none known, as in a plan)."""
        parts = [f"H={sync_every}", *([f"P={fragments}"] if fragments > 1 else [])]
        return f"{self.title}({', '.join([*parts, *self.details(knobs or {})])})"

    def details(self, knobs: dict) -> list[str]:
        """The knobs a row's name shows beside H and P (rows of other settings must differ)."""
        return []

    def build(self, cfg, view, *, device, comm, max_steps: int, bucket_cap_mb: float):
        raise NotImplementedError


ALGORITHMS: dict[str, OuterAlgorithm] = {}


def register(algorithm: OuterAlgorithm) -> OuterAlgorithm:
    """Add `algorithm` under its `outer.name` (a second one of the same name is refused)."""
    if algorithm.name in ALGORITHMS or algorithm.name in ("", "none"):
        raise ValueError(f"an outer algorithm named {algorithm.name!r} is registered already or not allowed")
    if not (isinstance(algorithm.schema, type) and issubclass(algorithm.schema, OuterConfig)):
        raise ValueError(f"outer algorithm {algorithm.name!r}: its schema must extend OuterConfig")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def check_window(cfg: OuterConfig) -> None:
    """The window's checks, every algorithm's: outer.sync_every >= 1, and outer.fragments >= 1
    dividing it (the checks against the model's blocks: `sdp.outer.validate_outer_with`)."""
    if cfg.sync_every < 1:
        raise ConfigError("outer.sync_every", cfg.sync_every, "must be >= 1 (1: a sync after every step)")
    if cfg.fragments < 1:
        raise ConfigError("outer.fragments", cfg.fragments, "must be >= 1 (1: the whole model at each sync)")
    if cfg.sync_every % cfg.fragments:
        raise ConfigError(
            "outer.fragments",
            cfg.fragments,
            f"must divide outer.sync_every={cfg.sync_every}: fragment p syncs every H steps, H / P steps after "
            "fragment p - 1",
        )


def algorithm_of(name) -> OuterAlgorithm | None:
    """The algorithm of `outer.name` (None: outer=none, a gradient average every step)."""
    name = str(name)
    if name == "none":
        return None
    if name not in ALGORITHMS:
        raise ConfigError("outer.name", name, f"allowed: none, {', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[name]


def schema_of(name) -> type:
    """The config dataclass of `outer.name`'s algorithm (OuterConfig for none)."""
    algorithm = algorithm_of(name)
    return OuterConfig if algorithm is None else algorithm.schema


def outer_label(name, *, sync_every: int | None, fragments: int = 1, knobs: dict | None = None) -> str:
    """ " + DiLoCo(H=10)" for a run with an outer loop, "" without (what a row's name ends with)."""
    algorithm = algorithm_of(name)
    if algorithm is None:
        return ""
    return f" + {algorithm.label(sync_every=sync_every, fragments=fragments, knobs=knobs)}"
