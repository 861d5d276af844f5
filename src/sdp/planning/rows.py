"""A plan's rows, typed: what every row shares (`RunFacts`) and one structure's outcome (`Row`).

plan.json is written from these (`to_json`) and read back into them (`from_json`); its keys are
those the planner always wrote: a row's derived figures (the busiest rank, its peak in GiB, the
headroom) are written beside the peaks they come from, so that a reader of the file needs
neither this module nor the devices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sdp.planning.fit import GIB, busiest_of
from sdp.planning.space import Structure


@dataclass(frozen=True)
class RunFacts:
    """What every row of a plan shares: the user's overrides, the world, the run's protocol, and
    the work of a step (`per_step` tokens or samples, `unit` says which)."""

    overrides: list[str]
    world: int
    protocol: str
    unit: str  # tokens | samples
    per_step: int

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> RunFacts:
        return cls(**data)


@dataclass
class Row:
    """One structure's row: refused by the entrypoint's checks (`refused` says why; nothing else
    is set), or traced: the micro-batch chosen (or 1, where nothing fits), each traced rank's
    predicted peak against its GPU, and, for a row that fits, its command and step.

    `peaks_bytes` and `devices_gib` are keyed by rank; `line_peaks_bytes` holds a line's peaks
    once whole traces replaced them (`sdp.planning.search.verify`)."""

    structure: Structure
    seconds: float
    refused: str | None = None
    fits: bool = False
    micro_batch: int = 0
    accum: int | None = None
    peaks_bytes: dict[int, int] = dataclasses.field(default_factory=dict)
    devices_gib: dict[int, float] = dataclasses.field(default_factory=dict)
    breakdown_gib: dict[str, float] = dataclasses.field(default_factory=dict)  # the busiest rank's peak by kind
    comm_groups: int = 0
    method: str = ""
    comm_bytes_per_step: float = 0
    # An outer loop's exchange, the busiest rank's: a window's payload and wire bytes (None: none).
    outer_sync: dict | None = None
    probes: int = 0
    caveat: str = ""
    command: str | None = None
    step_s: float | None = None
    exposed_comm_s: float | None = None
    per_s: float | None = None  # tokens or samples a second (`RunFacts.unit`)
    line_peaks_bytes: dict[int, int] | None = None
    # The step's compute terms (sdp.planning.step_time.step_terms): launches, seconds of the host
    # launching them, of FLOPs, of bytes, and of the device waiting for the host.
    step_terms: dict | None = None
    # objective=time_to_target (sdp.planning.quality): the row's time to the pilot's target as the
    # output reads it, and its value (seconds, or the ratio to DDP's at another scale; None: no pilot).
    to_target: str | None = None
    to_target_s: float | None = None

    @property
    def run(self) -> str:
        return self.structure.label

    @property
    def traced(self) -> bool:
        return self.refused is None

    @property
    def busiest_rank(self) -> int:
        """The traced rank that fills the largest share of its GPU."""
        return busiest_of(self.peaks_bytes, self.devices_gib)

    @property
    def peak_gib(self) -> float:
        return round(self.peaks_bytes[self.busiest_rank] / GIB, 3)

    @property
    def headroom(self) -> float:
        """The free share of the busiest rank's GPU (negative: over by that share), to 4 places."""
        r = self.busiest_rank
        return round(1 - self.peaks_bytes[r] / (self.devices_gib[r] * GIB), 4)

    @property
    def sync_every(self) -> int:
        """The inner steps between the row's syncs: 0 for a plain run (it averages every step)."""
        return self.structure.sync_every or 0

    def to_json(self, unit: str) -> dict:
        """The row as plan.json holds it (`unit`: the run's, naming the rate's key)."""
        out = {"run": self.run, "structure": structure_json(self.structure), "seconds": self.seconds, "fits": self.fits}
        if not self.traced:
            return {**out, "refused": self.refused}
        out |= {
            "micro_batch": self.micro_batch,
            "accum": self.accum,
            "peaks_bytes": self.peaks_bytes,
            "peaks_gib": {r: round(p / GIB, 3) for r, p in self.peaks_bytes.items()},
            "devices_gib": self.devices_gib,
            "busiest_rank": self.busiest_rank,
            "peak_gib": self.peak_gib,
            "headroom": self.headroom,
            "breakdown_gib": self.breakdown_gib,
            "comm_groups": self.comm_groups,
            "method": self.method,
            "comm_bytes_per_step": self.comm_bytes_per_step,
            "probes": self.probes,
            "caveat": self.caveat,
        }
        if self.outer_sync is not None:
            out["outer_sync"] = self.outer_sync
        if self.command is not None:
            out["command"] = self.command
        if self.step_s is not None:
            out |= {"step_s": self.step_s, "exposed_comm_s": self.exposed_comm_s, f"{unit}_per_s": self.per_s}
            out["step_terms"] = self.step_terms
        if self.line_peaks_bytes is not None:
            out["line_peaks_bytes"] = self.line_peaks_bytes
        if self.to_target is not None:
            out |= {"to_target": self.to_target, "to_target_value": self.to_target_s}
        return out

    @classmethod
    def from_json(cls, data: dict, unit: str) -> Row:
        """A row of plan.json (its rank keys, strings there, back to integers)."""
        structure = structure_from_json(data["structure"])
        if "refused" in data:
            return cls(structure, data["seconds"], refused=data["refused"], fits=data["fits"])

        def ranks(d: dict | None) -> dict | None:
            return None if d is None else {int(r): v for r, v in d.items()}

        keep = ("fits", "micro_batch", "accum", "breakdown_gib", "comm_groups", "method", "comm_bytes_per_step")
        return cls(
            structure,
            data["seconds"],
            **{k: data[k] for k in keep},
            peaks_bytes=ranks(data["peaks_bytes"]),
            devices_gib=ranks(data["devices_gib"]),
            probes=data["probes"],
            caveat=data["caveat"],
            outer_sync=data.get("outer_sync"),
            command=data.get("command"),
            step_s=data.get("step_s"),
            exposed_comm_s=data.get("exposed_comm_s"),
            per_s=data.get(f"{unit}_per_s"),
            line_peaks_bytes=ranks(data.get("line_peaks_bytes")),
            step_terms=data.get("step_terms"),
            to_target=data.get("to_target"),
            to_target_s=data.get("to_target_value"),
        )


def structure_json(s: Structure) -> dict:
    """A structure as plan.json holds it (no granularity without SDP)."""
    return {
        "parallelism": s.parallelism,
        "masking": s.masking,
        "granularity": s.granularity if s.masking != "none" else None,
        "coverage": s.coverage,
        "capacity": None if s.capacity is None else list(s.capacity),
        "fsdp_degree": s.fsdp_degree,
        "activation_checkpointing": s.checkpointing,
        "mixed_precision": s.precision,
        "sync_every": s.sync_every,
        "outer": s.outer,
    }


def structure_from_json(data: dict) -> Structure:
    return Structure(
        parallelism=data["parallelism"],
        masking=data["masking"],
        granularity=data["granularity"] or Structure.granularity,
        coverage=data["coverage"],
        capacity=None if data["capacity"] is None else tuple(data["capacity"]),
        fsdp_degree=data["fsdp_degree"],
        checkpointing=data["activation_checkpointing"],
        precision=data["mixed_precision"],
        sync_every=data["sync_every"],
        outer=data.get("outer", "diloco" if data["sync_every"] is not None else None),  # plans before 61: DiLoCo
    )
