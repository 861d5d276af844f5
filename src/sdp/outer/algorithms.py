"""Outer algorithms as plug-ins: one object per `outer.name`, found in `ALGORITHMS`.

An algorithm owns what differs between methods that take local steps and sync now and then:
the checks on its knobs (`validate`), its name in tables, plans and estimates (`label`), and the
loop that runs its syncs over a strategy's `OuterView` (`build`: an object with `start`,
`after_step`, `restore`, `device_state`, as `sdp.outer.loop.OuterLoop` has). The run, the
estimator and the tables ask the registry; none names an algorithm. DiLoCo is the first.
"""

from __future__ import annotations

import math

from sdp.errors import ConfigError


class OuterAlgorithm:
    """The base of an outer algorithm (see the module docstring); `name` is its `outer.name`."""

    name = ""
    title = ""  # as tables and plans name it

    def validate(self, cfg) -> None:
        """The checks on its outer.* knobs alone, one ConfigError naming the key."""

    def label(self, *, sync_every: int, fragments: int = 1) -> str:
        parts = [f"H={sync_every}", *([f"P={fragments}"] if fragments > 1 else [])]
        return f"{self.title}({', '.join(parts)})"

    def build(self, cfg, view, *, device, comm, max_steps: int, bucket_cap_mb: float):
        raise NotImplementedError


ALGORITHMS: dict[str, OuterAlgorithm] = {}


def register(algorithm: OuterAlgorithm) -> OuterAlgorithm:
    """Add `algorithm` under its `outer.name` (a second one of the same name is refused)."""
    if algorithm.name in ALGORITHMS or algorithm.name in ("", "none"):
        raise ValueError(f"an outer algorithm named {algorithm.name!r} is registered already or not allowed")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def algorithm_of(name) -> OuterAlgorithm | None:
    """The algorithm of `outer.name` (None: outer=none, a gradient average every step)."""
    name = str(name)
    if name == "none":
        return None
    if name not in ALGORITHMS:
        raise ConfigError("outer.name", name, f"allowed: none, {', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[name]


def outer_label(name, *, sync_every: int | None, fragments: int = 1) -> str:
    """ " + DiLoCo(H=10)" for a run with an outer loop, "" without (what a row's name ends with)."""
    algorithm = algorithm_of(name)
    return "" if algorithm is None else f" + {algorithm.label(sync_every=sync_every, fragments=fragments)}"


class DiLoCo(OuterAlgorithm):
    """DiLoCo (arXiv 2311.08105), with Streaming DiLoCo's fragments (arXiv 2501.18512): each
    worker steps alone for H steps, then the holders average each tensor's pseudo-gradient and
    an outer Nesterov SGD step moves theta_prev (`sdp.outer.loop`)."""

    name, title = "diloco", "DiLoCo"

    def validate(self, cfg) -> None:
        if cfg.sync_every < 1:
            raise ConfigError("outer.sync_every", cfg.sync_every, "must be >= 1 (1: a sync after every step)")
        if not (math.isfinite(cfg.lr) and cfg.lr > 0):
            raise ConfigError("outer.lr", cfg.lr, "must be a finite number > 0 (DiLoCo's: 0.7)")
        if not (math.isfinite(cfg.momentum) and 0 <= cfg.momentum < 1):
            raise ConfigError("outer.momentum", cfg.momentum, "must be in [0, 1) (DiLoCo's: 0.9; 0: no momentum)")
        if cfg.fragments < 1:
            raise ConfigError("outer.fragments", cfg.fragments, "must be >= 1 (1: the whole model at each sync)")
        if cfg.sync_every % cfg.fragments:
            raise ConfigError(
                "outer.fragments",
                cfg.fragments,
                f"must divide outer.sync_every={cfg.sync_every}: fragment p syncs every H steps, H / P steps after "
                "fragment p - 1",
            )

    def build(self, cfg, view, *, device, comm, max_steps: int, bucket_cap_mb: float):
        from sdp.outer.loop import OuterLoop  # noqa: PLC0415 (the loop's imports: only a run with one)

        return OuterLoop(cfg, view, device=device, comm=comm, max_steps=max_steps, bucket_cap_mb=bucket_cap_mb)


register(DiLoCo())
