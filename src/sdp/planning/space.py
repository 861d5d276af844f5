"""What `sdp.plan` searches: the devices a user has, and the configurations that could train on them.

A *structure* is everything about a run's memory and speed but its micro-batch: DDP or FSDP,
activation checkpointing, precision, and SDP's masking mode, units and coverage (or, on
devices of different memory, per-worker capacities), alone or with FSDP inside each worker.
For each structure the planner then picks the micro-batch (`trainer.grad_accum_steps`,
`sdp.planning.fit`), so the micro-batch is not a dimension of this space.

Given an outer loop (`outer=diloco`, or any algorithm of `sdp.outer.algorithms`), the planner
also weighs each DDP and SDP structure with it at every searched `sync_every` (H; FSDP refuses an
outer loop, so its structures are weighed without): `Structure.outer` and `.sync_every`, None for
the plain run.

SDP's coverages are r / K for r holders per unit. By default the planner weighs those on the
grid the paper and our replica tables measure (0.75, 0.5, 0.25, and 0.125 below it), the
quality caveats of the replica reports (planning/report.py) speak of; `every=True` weighs every r / K.

Devices are given in GiB (2**30 bytes) per GPU: `8x80`, `[80,80,24,24]`, or `4x80+4x24`; a size
may carry the suffix GiB (`8x80GiB`). GB is refused: it may mean 1e9 bytes, and a card sold as
80 GB has about 80 GiB (nvidia-smi's MiB / 1024), the number to give.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from sdp.errors import ConfigError
from sdp.outer.algorithms import outer_label
from sdp.subnet.capacity import listed
from sdp.subnet.modes import MODES, masking_overrides

DEVICES_FORMS = "NxGIB (8x80), a list of GiB per GPU ([80,80,24,24]), or parts joined by + (4x80+4x24)"
MAX_DEVICES = 65536
PRECISIONS = ("fp32", "bf16")
CHECKPOINTING = ("none", "selective", "full")
GRID = (0.75, 0.5, 0.25, 0.125)  # the default coverages, where r / K hits them
STACK_PRECISION = "bf16"  # SDP x FSDP is weighed in it alone when it is searched (the paper's stack, M2)
SYNC_EVERY = (1, 10, 50, 100)  # with an outer loop: the H searched by default
SHARE = 0.25  # mixed devices: capacities are multiples of this share (few holder sets, few communicators)


def parse_devices(text: str) -> list[float]:
    """GiB of every GPU, in rank order, from `devices=`; one ConfigError naming the forms otherwise."""
    spec = text.strip().replace(" ", "")
    found: list[float] = []
    if spec.startswith("[") and spec.endswith("]"):
        parts = spec[1:-1].split(",")
        found = [_gib(text, p) for p in parts] if all(parts) else []
    else:
        for part in spec.split("+"):
            m = re.fullmatch(r"(\d+)[xX]([0-9.]+[A-Za-z]*)", part)
            if m is not None and int(m.group(1)) == 0:
                raise ConfigError("devices", text, f"has {part}: no GPU; each part needs at least one device (1x80)")
            if m is None or int(m.group(1)) > MAX_DEVICES:
                found = []
                break
            found += [_gib(text, m.group(2))] * int(m.group(1))
    if not found or len(found) > MAX_DEVICES:
        raise ConfigError("devices", text, f"must be {DEVICES_FORMS}, at most {MAX_DEVICES} GPUs")
    return found


def _gib(text: str, part: str) -> float:
    """One GPU's GiB from `part`: a number, or one with the suffix GiB; a GB (whose meaning,
    1e9 or 2**30 bytes, a reader must guess) is refused with the GiB to give."""
    number, unit = re.fullmatch(r"(.*?)([A-Za-z]*)", part).groups()
    if unit and unit.lower() != "gib" and number and unit.lower() not in ("nan", "inf", "infinity"):
        raise ConfigError(
            "devices",
            text,
            f"has {part}: sizes are GiB (2**30 bytes): give {number} or {number}GiB (a card sold as "
            f"{number} GB holds about {number} GiB: nvidia-smi's MiB / 1024)",
        )
    part = number if unit.lower() == "gib" else part
    try:
        gib = float(part)
    except ValueError:
        raise ConfigError("devices", text, f"must be {DEVICES_FORMS}; {part!r} is not a number of GiB") from None
    if not 0 < gib <= 1e6:
        raise ConfigError("devices", text, f"has {part} GiB: each GPU's memory must be a number in (0, 1e6]")
    return gib


@dataclass(frozen=True)
class Structure:
    """A run's choices but its micro-batch. `coverage` is SDP's (None: DDP or FSDP); `capacity`
    replaces it on mixed devices; `fsdp_degree` > 1 is FSDP inside each SDP worker; `sync_every`
    is an outer loop's H and `outer` its algorithm (None: none)."""

    parallelism: str = "ddp"  # ddp | fsdp
    masking: str = "none"  # none | backward | forward
    granularity: str = "neuron"
    coverage: float | None = None
    capacity: tuple[float, ...] | None = None
    fsdp_degree: int = 1
    checkpointing: str = "none"
    precision: str = "fp32"
    sync_every: int | None = None
    outer: str | None = None  # the outer algorithm (outer.name) of `sync_every`: diloco unless named

    def __post_init__(self):
        if self.sync_every is not None and self.outer is None:
            object.__setattr__(self, "outer", "diloco")

    @property
    def label(self) -> str:
        if self.masking == "none":
            label = "FSDP" if self.parallelism == "fsdp" else "DDP"
        else:
            label = f"{self.granularity[0].upper()}-SDP {self.masking}"
            label += f" C={self.coverage:g}" if self.capacity is None else f" capacity {listed(self.capacity)}"
            label += f" x FSDP({self.fsdp_degree})" if self.fsdp_degree > 1 else ""
        label += {"none": "", "selective": " + AC(sel)", "full": " + AC"}[self.checkpointing]
        label += " + bf16" if self.precision == "bf16" else ""
        return label + ("" if self.sync_every is None else outer_label(self.outer, sync_every=self.sync_every))

    def overrides(self) -> list[str]:
        """The command-line overrides that give this structure (on top of the user's own)."""
        out = masking_overrides(self.masking)
        if self.masking != "none":
            out.append(f"masking.granularity={self.granularity}")
            out.append(
                f"masking.coverage={self.coverage:g}"
                if self.capacity is None
                else f"masking.capacity={listed(self.capacity)}"
            )
        out.append(f"parallelism={self.parallelism}")
        if self.fsdp_degree > 1:
            out.append(f"parallelism.fsdp_degree={self.fsdp_degree}")
        if self.checkpointing != "none":
            out.append(f"parallelism.activation_checkpointing={self.checkpointing}")
        if self.precision != "fp32":
            out.append(f"parallelism.mixed_precision={self.precision}")
        if self.sync_every is not None:  # outer=NAME is the user's (see `outer_free`)
            out.append(f"outer.sync_every={self.sync_every}")
        return out


def coverages(workers: int, *, min_coverage: float, every: bool = True) -> list[float]:
    """SDP's coverages for K workers, r / K for r holders, from the largest below 1 down to
    `min_coverage`: all of them, or (every=False) those on GRID, all of them when none is."""
    found = [r / workers for r in range(workers - 1, 0, -1) if r / workers >= min_coverage - 1e-9]
    grid = [c for c in found if any(abs(c - g) < 1e-9 for g in GRID)]
    return found if every or not grid else grid


def capacity_lists(devices: list[float], *, min_coverage: float) -> list[tuple[float, ...]]:
    """Mixed devices: per-worker capacities proportional to each GPU's memory, at full scale and
    scaled down (so that a model larger than the biggest card fits), in multiples of SHARE,
    each at least SHARE, their mean (the run's coverage) at least `min_coverage`, summing to at
    least 1; [] on uniform devices."""
    if len(set(devices)) == 1:
        return []
    largest, out = max(devices), []
    for scale in (1.0, 0.75, 0.5):
        shares = tuple(max(SHARE, min(1.0, SHARE * int(scale * d / largest / SHARE + 1e-9))) for d in devices)
        mean_ok = sum(shares) / len(shares) >= min_coverage - 1e-9
        if mean_ok and sum(shares) >= 1 and len(set(shares)) > 1 and shares not in out:
            out.append(shares)
    return out


def structures(
    devices: list[float],
    *,
    min_coverage: float,
    granularities: tuple[str, ...],
    every: bool = True,
    precisions: tuple[str, ...] = PRECISIONS,
    checkpointing: tuple[str, ...] = CHECKPOINTING,
    sync_every: tuple[int, ...] = (),
    outer: str | None = None,
) -> list[Structure]:
    """Every structure the planner weighs for these devices (one SDP worker per GPU, or F GPUs of
    equal memory per worker under SDP x FSDP, in bf16 when bf16 is searched: the paper's stacked
    configuration); `every`: all coverages r / K, not the grid's; each DDP and SDP structure
    also with the outer loop of algorithm `outer` (None: DiLoCo, as `Structure` takes it) at each
    of `sync_every`, right after it."""
    k = len(devices)
    sdp = [{"coverage": c} for c in coverages(k, min_coverage=min_coverage, every=every)] + [
        {"capacity": cap} for cap in capacity_lists(devices, min_coverage=min_coverage)
    ]
    out = []
    for precision in precisions:
        for ac in checkpointing:
            common = {"checkpointing": ac, "precision": precision}
            out.append(Structure(**common))
            if k > 1:
                out.append(Structure(parallelism="fsdp", **common))
            for mode in MODES:  # every registered masking mode
                for gran in granularities:
                    out += [Structure(masking=mode, granularity=gran, **choice, **common) for choice in sdp]
            if precision != STACK_PRECISION and STACK_PRECISION in precisions:
                continue
            out += [
                Structure("fsdp", mode, gran, coverage=c, fsdp_degree=f, **common)
                for mode, spec in MODES.items()
                if spec.shards
                for f in _fsdp_degrees(devices)
                for gran in granularities
                for c in coverages(k // f, min_coverage=min_coverage, every=every)
            ]
    if not sync_every:
        return out
    local = [[s, *(dataclasses.replace(s, sync_every=h, outer=outer) for h in sync_every)] for s in out]
    return [t for s, group in zip(out, local, strict=True) for t in (group if s.parallelism == "ddp" else [s])]


def outer_free(overrides: list[str]) -> list[str]:
    """The user's overrides without the outer loop's (outer=NAME, outer.KEY=...): a plain
    structure's, where the planner weighs the run without one."""
    return [a for a in overrides if a.lstrip("+~").partition("=")[0].split(".")[0] != "outer"]


def _fsdp_degrees(devices: list[float]) -> list[int]:
    """SDP x FSDP's shard-group sizes F: proper divisors of the world > 1 whose groups of F
    consecutive GPUs have equal memory (a worker's shards are the same size on each)."""
    k = len(devices)
    return [
        f
        for f in range(2, k)
        if k % f == 0 and k // f > 1 and all(len(set(devices[i : i + f])) == 1 for i in range(0, k, f))
    ]


def command(base: list[str], structure: Structure, *, nproc: int, accum: int, nnodes: int = 1) -> str:
    """The exact `python -m sdp.train` line of a candidate: the user's overrides, the structure's,
    and its gradient accumulation; on several nodes, torchrun's rendezvous at $MASTER_ADDR."""
    launch = f"--nproc-per-node={nproc // nnodes}"
    if nnodes > 1:  # the same line on every node; MASTER_ADDR: the first node's address
        launch += f" --nnodes={nnodes} --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:29500"
    own = base if structure.sync_every is not None else outer_free(base)
    args = [*own, *structure.overrides(), f"trainer.grad_accum_steps={accum}"]
    return f"python -m sdp.train {launch} " + " ".join(_quoted(a) for a in args)


def _quoted(arg: str) -> str:
    """An argument as a shell reads it back unchanged (brackets and commas quoted)."""
    return f"'{arg}'" if re.search(r"[^\w.=+/:@-]", arg) else arg
