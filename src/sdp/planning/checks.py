"""The planner's checks of a config, kept on disk beside its traces.

Before it searches, the planner checks the user's config and each structure's as the entrypoint
would (`sdp.run.config.validate`), and that builds the model on the meta device: for a LLaMA,
importing transformers alone takes 2.6 s of a call that otherwise reads every trace back. A
check depends on what a trace depends on (the typed config, the world size and the code,
`sdp.planning.traces.code_version`), so a config checked for this world and this code gets
the same answer again: `CheckCache` keeps each answer in `DIR/checks` (`cache=DIR`), what a
pass tells the search (`Checked`: from the SDP plan the checks build, which the search would
otherwise build again in its workers) or the refusal's key, value and reason (raised again as
the same `ConfigError`), and checks only configs it has no answer for. A refusal whose value
does not survive JSON unchanged is checked again on every call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from sdp.errors import ConfigError
from sdp.planning.layered import extends, spread_of
from sdp.planning.ranks import busiest_of_plan
from sdp.planning.traces import code_version, write_whole
from sdp.run.config import RunConfig, validate


@dataclass(frozen=True)
class Checked:
    """What checking a config tells the search besides that it passed, from the SDP plan the
    checks built: the rank a walk on equal GPUs traces (`ranks.busiest_rank`) and the
    process groups each rank joins (`ranks.planned_groups`) and how far each rank's held
    units are from the line in the depth (`layered.layer_spread`, for a run that `extends`)."""

    busiest_rank: int
    groups: tuple[int, ...]
    spread: tuple[float, ...] | None  # each rank's `layered.layer_spread`; None: not on a line in the depth


class CheckCache:
    """`validate(cfg, world_size=..., offline=True, check_data=False)` and what it tells
    (`Checked`), answered from disk for a config checked before for the world and the code
    (`root=None`: always checked). `checked` and `read` count this process's calls."""

    def __init__(self, root: Path | None):
        self.root = None if root is None else root / "checks"
        self.checked = self.read = 0

    def __call__(self, cfg: RunConfig, *, world_size: int) -> Checked:
        if self.root is None:
            self.checked += 1
            return _check(cfg, world_size=world_size)
        name = f"{code_version()}\ncheck {world_size}\n{cfg!r}"
        path = self.root / f"{hashlib.sha256(name.encode()).hexdigest()}.json"
        found = _answer(path, name)
        if found is not None:
            self.read += 1
            if isinstance(found, ConfigError):
                raise found
            return found
        self.checked += 1
        try:
            checked = _check(cfg, world_size=world_size)
        except ConfigError as err:
            if repr(json.loads(json.dumps(err.value, default=repr))) == repr(err.value):  # it reads back the same
                write_whole(path, json.dumps({"key": name, "refused": [err.key, err.value, err.allowed]}))
            raise
        write_whole(path, json.dumps({"key": name, "refused": None, **dataclasses.asdict(checked)}))
        return checked


def _check(cfg: RunConfig, *, world_size: int) -> Checked:
    plan = validate(cfg, world_size=world_size, offline=True, check_data=False)
    if plan is None:  # no SDP: every rank in the world's group alone, all on the line
        return Checked(0, (1,) * world_size, (0.0,) * world_size if extends(cfg) else None)
    groups = plan.comm_groups(steps=cfg.trainer.max_steps)
    spread = tuple(spread_of(plan, rank=r) for r in range(world_size)) if extends(cfg) else None
    return Checked(busiest_of_plan(plan, world_size=world_size), tuple(groups), spread)


def _answer(path: Path, name: str) -> Checked | ConfigError | None:
    """The answer kept for the check `name`: what it told, or the refusal; None when there is
    none (no file, half a file of a writer that died, another check's file)."""
    try:
        entry = json.loads(path.read_text())
        if not isinstance(entry, dict) or entry.get("key") != name:
            return None
        if entry["refused"] is not None:
            key, value, allowed = entry["refused"]
            return ConfigError(key, value, allowed)
        spread = entry["spread"]
        spread = None if spread is None else tuple(float(x) for x in spread)
        return Checked(int(entry["busiest_rank"]), tuple(int(g) for g in entry["groups"]), spread)
    except (OSError, ValueError, TypeError, KeyError):
        return None
