"""Time to a target quality: `sdp.plan objective=time_to_target quality=PATH` ranks the rows that
fit by the modelled step times the steps a pilot sweep needed to reach its target.

A pilot is a table `sdp.collect` wrote (its CSV) or a folder of one table's run dirs (read as the
collector reads them). Its target is the table's: 99% of DDP's final eval accuracy, or DDP's final
eval loss / 0.99 (`sdp.analysis.target`); each row records what it ran (`pilot_columns` of
`sdp.analysis.tables`) and the mean steps its runs took to first reach the target.

- A plan row matches the pilot's rows of its masking, granularity, coverage and outer loop
  (algorithm and H). Precision, activation checkpointing and FSDP change how a step is computed,
  not what it learns: they match too. Dense controls (inner width < 1, dropout, stochastic depth)
  and uneven capacities are not plan rows of a pilot.
- Protocols: a FLOP-matched row is the same variant given a longer budget. A variant's steps to
  target are the fewest over its rows that reached it; it is censored, at its longest budget,
  when none did.
- Scale: when the pilot ran the plan's model (and inner width), K, global batch and sequence
  length, time to target is the step times the steps, in seconds. At another scale only ratios
  to the pilot's DDP carry over: time to target relative to DDP's (step ratio x steps ratio).
- Order: rows that reached the target by their time; then censored ones, by their lower bound
  (the step times the budget: "not reached in N steps"); then rows the pilot did not run
  ("no pilot"), by step.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from sdp.errors import ConfigError
from sdp.planning.rows import Row
from sdp.planning.space import Structure

DDP = ("none", None, 1.0, None, None)  # the variant key of DDP (and FSDP): no masking, no outer loop
SCALE = ("model", "inner_width", "world_size", "global_batch", "seq_len")  # what must match for seconds
NEEDED = ("variant", "coverage", "protocol", "steps", "target", "target_steps", "kind", "masking", *SCALE)
NEEDED += ("granularity", "outer", "sync_every")


def variant_key(masking: str, granularity, coverage, outer, sync_every) -> tuple:
    """What a pilot row and a plan row must share: masking, granularity, coverage, outer loop, H."""
    looped = outer not in (None, "", "none")
    loop = (str(outer), int(float(sync_every))) if looped else (None, None)
    if masking == "none":
        return ("none", None, 1.0, *loop)
    return (masking, granularity or None, round(float(coverage), 6), *loop)


def structure_key(s: Structure, *, outer: str) -> tuple | None:
    """A plan structure's variant key (None: uneven capacities, which no pilot row is)."""
    if s.capacity is not None:
        return None
    return variant_key(s.masking, s.granularity, s.coverage or 1.0, outer if s.sync_every else None, s.sync_every)


@dataclass(frozen=True)
class Reach:
    """A variant's steps to the target (None: not reached), the longest budget it ran, and the
    protocol of the row its figure comes from."""

    steps: float | None
    budget: int
    protocol: str


@dataclass(frozen=True)
class Pilot:
    source: str
    kind: str  # image | text
    target: float
    scale: dict
    reach: dict[tuple, Reach]

    @property
    def ddp(self) -> Reach:
        return self.reach[DDP]

    def target_words(self) -> str:
        if self.kind == "image":
            return f"eval accuracy >= {self.target:.4g} (99% of DDP's final)"
        return f"eval loss <= {self.target:.4g} (DDP's final / 0.99)"

    def scale_words(self) -> str:
        s = self.scale
        seq = f" x seq {s['seq_len']}" if s.get("seq_len") else ""
        width = "" if float(s["inner_width"]) == 1 else f" (inner width {s['inner_width']:g})"
        return f"{s['model']}{width}, K = {s['world_size']}, global batch {s['global_batch']}{seq}"


def _value(text):
    """A CSV cell as the collector wrote it: '' is None, numbers are numbers."""
    if text in (None, ""):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def pilot_rows(path: Path) -> list[dict]:
    """The rows of a pilot: a collect CSV's, or those the collector builds from a folder of one
    table's run dirs. Bad input is one ConfigError naming `quality`."""
    if path.is_dir():
        from sdp.analysis.tables import build_rows, find_runs  # noqa: PLC0415 (reads run dirs)

        tables = build_rows(find_runs([path]))
        if len(tables) != 1:
            names = ", ".join(sorted(tables)) or "none"
            raise ConfigError("quality", str(path), f"holds {len(tables)} tables ({names}): give one table's runs")
        return next(iter(tables.values()))["rows"]
    if not path.is_file():
        raise ConfigError("quality", str(path), "is neither a collect CSV nor a folder of run dirs")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [k for k in NEEDED if k not in (reader.fieldnames or [])]
        if len(missing) == len(NEEDED):
            raise ConfigError("quality", str(path), "is neither a collect CSV nor a folder of run dirs")
        if missing:
            why = f"lacks the columns {', '.join(missing)} (run sdp.collect on its run dirs again)"
            raise ConfigError("quality", str(path), why)
        return [{k: _value(v) for k, v in row.items()} for row in reader]


def load_pilot(path: Path, *, kind: str) -> Pilot:
    """The pilot at `path`, its variants' steps to target merged over protocols; refused when it
    has no DDP row, no target, or another data kind than the plan's (`kind`)."""
    rows = [r for r in pilot_rows(path) if r.get("masking") in ("none", "backward", "forward")]
    rows = [r for r in rows if float(r.get("inner_width") or 1) == 1]  # dense controls are not plan rows
    kinds = {r.get("kind") for r in rows}
    if kinds and kinds != {kind}:
        theirs = "/".join(map(str, sorted(kinds, key=str)))
        raise ConfigError("quality", str(path), f"is a pilot on {theirs} data; this plan's is {kind}")
    by_key: dict[tuple, list[dict]] = {}
    for r in rows:
        key = variant_key(r["masking"], r.get("granularity"), r["coverage"], r.get("outer"), r.get("sync_every"))
        by_key.setdefault(key, []).append(r)
    if DDP not in by_key:
        raise ConfigError("quality", str(path), "has no DDP row: time to target is measured against DDP's")
    ddp = min(by_key[DDP], key=lambda r: r["variant"] != "DDP")  # DDP before FSDP
    if ddp.get("target") is None or ddp.get("target_steps") is None:
        raise ConfigError("quality", str(path), "has no target DDP reached (its DDP row has no target_steps)")
    reach = {key: _merged(members) for key, members in by_key.items()}
    return Pilot(str(path), kind, float(ddp["target"]), {k: ddp.get(k) for k in SCALE}, reach)


def _merged(members: list[dict]) -> Reach:
    """A variant's reach over its rows (protocols): the fewest steps that reached the target, or
    censored at the longest budget."""
    budget = max(int(m["steps"]) for m in members)
    reached = [m for m in members if m.get("target_steps") is not None]
    if reached:
        best = min(reached, key=lambda m: float(m["target_steps"]))
        return Reach(float(best["target_steps"]), budget, best["protocol"])
    return Reach(None, budget, max(members, key=lambda m: int(m["steps"]))["protocol"])


def same_scale(pilot: Pilot, plan: dict) -> bool:
    """Whether the pilot ran the plan's model, inner width, K, global batch and sequence length."""
    return all(_same(pilot.scale.get(k), plan.get(k)) for k in SCALE)


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, str) or isinstance(b, str):
        return str(a) == str(b)
    return math.isclose(float(a), float(b))


def to_target(rows: list[Row], pilot: Pilot, *, outer: str, seconds: bool) -> list[Row]:
    """The fitting rows ranked by time to target (see the module docstring), each with its
    `to_target` line and `to_target_s` (seconds, or the ratio to DDP's at another scale)."""
    fitting = [r for r in rows if r.fits and r.step_s is not None]
    ddp_steps = pilot.ddp.steps
    ddp_rows = [r for r in fitting if structure_key(r.structure, outer=outer) == DDP]
    ddp_time = min((r.step_s * ddp_steps for r in ddp_rows), default=None)
    reached, censored, unknown = [], [], []
    for r in fitting:
        key = structure_key(r.structure, outer=outer)
        reach = pilot.reach.get(key) if key is not None else None
        if reach is None:
            r.to_target, r.to_target_s = "no pilot", None
            unknown.append(r)
            continue
        steps = reach.steps if reach.steps is not None else reach.budget
        time = r.step_s * steps
        value = time if seconds else (None if ddp_time is None else time / ddp_time)
        r.to_target_s = value
        r.to_target = _words(reach, value, seconds=seconds, ddp_steps=ddp_steps)
        (reached if reach.steps is not None else censored).append((time, r))
    order = [r for _, r in sorted(reached, key=lambda p: p[0])] + [r for _, r in sorted(censored, key=lambda p: p[0])]
    return order + sorted(unknown, key=lambda r: r.step_s)


def _words(reach: Reach, value: float | None, *, seconds: bool, ddp_steps: float) -> str:
    """A row's time to target as the output reads it."""
    if value is None:
        when = "(no DDP row fits this plan: no ratio)"
    elif seconds:
        when = f"{value:,.1f} s"
    else:
        when = f"{value:.2f} x DDP's"
    if reach.steps is None:
        bound = reach.budget / ddp_steps
        return f"not reached in {reach.budget:,} steps ({reach.protocol}): >= {when}, >= {bound:.2f} x DDP's steps"
    ratio = reach.steps / ddp_steps
    return f"{reach.steps:,.0f} steps ({reach.protocol}, {ratio:.2f} x DDP's): {when}"


@dataclass(frozen=True)
class TargetRanking:
    """objective=time_to_target's ranking: the pilot, the plan's outer algorithm (what its H rows
    run), and whether the pilot ran the plan's scale (seconds) or another (ratios to DDP's)."""

    pilot: Pilot
    outer: str
    seconds: bool

    def __call__(self, rows: list[Row]) -> list[Row]:
        return to_target(rows, self.pilot, outer=self.outer, seconds=self.seconds)

    def line(self) -> str:
        if self.seconds:
            scale = "the plan's own: time to target in seconds"
        else:
            scale = "not the plan's: time to target relative to DDP's (step ratio x steps ratio), not in seconds"
        pilot = self.pilot
        return f"pilot {pilot.source}: target {pilot.target_words()}; ran {pilot.scale_words()} ({scale})"


def target_ranking(path: Path, cfg, *, world: int, outer: str) -> TargetRanking:
    """The ranking by the pilot at `path` for a plan of `cfg` (the run's config) on `world` GPUs."""
    kind = cfg.dataset.kind
    pilot = load_pilot(path, kind=kind)
    plan = {
        "model": cfg.model.name,
        "inner_width": cfg.model.inner_width,
        "world_size": world,
        "global_batch": cfg.trainer.global_batch_size,
        "seq_len": cfg.dataset.seq_len if kind == "text" else None,
    }
    return TargetRanking(pilot, outer, same_scale(pilot, plan))


NO_PILOT = (
    "to rank by time to a target quality instead: objective=time_to_target quality=PATH (a pilot sweep's "
    "collect CSV or folder of run dirs; docs/plan.md)"
)
