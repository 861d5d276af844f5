"""Resuming a run: the checks before any process group (the run dir's checkpoints, and the
config they were written with against this launch's), choosing the newest intact checkpoint
(each rank checks a share of its files against the manifest), and loading it into the strategy,
the optimizer and the schedule on any world size. `sdp.run.checkpoint` writes what this reads;
docs/resuming.md describes both.

Before loading, the ranks check the newest checkpoint's files against its manifest (each rank
a share of the files); a damaged one is skipped, with a warning, for the one before it. Files
are loaded with `weights_only=True`: loading a checkpoint never runs code from it."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sdp import dist
from sdp.errors import ConfigError
from sdp.optim import load_schedule
from sdp.parallel import PortableState
from sdp.paths import DamagedFile, read_yaml_mapping
from sdp.run.checkpoint import FORMAT, Checkpoint, complete_checkpoints, file_digest
from sdp.run.config import by_dotted_key
from sdp.rundir import CONFIG, METRICS, run_status

# What a resume may change: where the run lives (a run dir is the run, however its path is
# spelled: relative, with a trailing slash, through a symlink, or after the directory was
# moved), settings that do not change what a run computes, and parallelism.fsdp_degree and
# masking.capacity, which like the world size only change K or who holds what (checkpoints
# are portable: the state is re-cut; the capacities' mean, masking.coverage, must stay).
RESUME_MAY_CHANGE = (
    "run_dir",
    "output_root",
    "name",
    "logger",
    "trainer.progress",
    "trainer.stop_at_step",
    "trainer.checkpoint_every",
    "trainer.keep_checkpoints",
    "trainer.on_nonfinite",
    "trainer.max_nonfinite_skips",
    "parallelism.timeout_s",
    "parallelism.fsdp_degree",
    "masking.capacity",
)


def resume_view(config: dict | None) -> dict | None:
    """A copy of a resolved config without the keys a resume may change: what a resume compares
    (the current launch's with the one its checkpoint recorded, either side of any version)."""
    if not isinstance(config, dict):
        return config
    config = copy.deepcopy(config)
    for dotted in RESUME_MAY_CHANGE:
        *path, last = dotted.split(".")
        node = config
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return config


_ABSENT = "<absent>"
# Keys added after run dirs were first recorded, each with the value every run recorded before it
# ran with: a config.yaml without the key is the same run as a config that holds that value.
ADDED_KEYS = {"trainer.plateau_threshold": 0.005, "model.inner_width": 1.0, "model.base_width": 64}


def differences(a, b, prefix: str = "") -> Iterator[str]:
    """Every dotted key where two nested config containers differ, in key order, as 'key: old -> new'
    (a key of ADDED_KEYS that one side lacks differs only from another value than its old one)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                if ADDED_KEYS.get(f"{prefix}{key}", _ABSENT) == a.get(key, b.get(key)):
                    continue
                yield f"{prefix}{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}"
            else:
                yield from differences(a[key], b[key], f"{prefix}{key}.")
    elif a != b:
        yield f"{prefix.rstrip('.')}: {a!r} -> {b!r}"


def first_difference(a, b, prefix: str = "") -> str | None:
    """The first dotted key where two nested config containers differ, as 'key: old -> new'."""
    return next(differences(a, b, prefix), None)


MAX_SHOWN = 5  # the keys an edited config.yaml's warning names


def config_edits(path: Path, config: dict, recorded: dict | None) -> str | None:
    """When the run dir's config.yaml (`path`) was edited by hand (a resume rewrites it), one
    warning naming each edited key, 'key: the file's -> this command's'; None otherwise. A key
    is edited when the file holds neither this command's value (`config`) nor the one the
    checkpoint recorded (`recorded`: the launch that wrote both), so a key the command changes
    on resume is not one."""
    if not path.is_file():
        return None
    try:
        file = by_dotted_key(read_yaml_mapping(path))
    except DamagedFile as err:
        return f"{path} {err.allowed}; it is rewritten with this command's config"
    now, then = by_dotted_key(config), by_dotted_key(recorded or config)
    edited = [
        k
        for k in sorted(set(file) | set(now))
        if file.get(k, ADDED_KEYS.get(k, _ABSENT)) not in (now.get(k, _ABSENT), then.get(k, ADDED_KEYS.get(k, _ABSENT)))
    ]
    if not edited:
        return None
    shown = [f"{k}: {file.get(k, _ABSENT)!r} -> {now.get(k, _ABSENT)!r}" for k in edited[:MAX_SHOWN]]
    more = f"; and {len(edited) - MAX_SHOWN} more" if len(edited) > MAX_SHOWN else ""
    return (
        f"{path} was edited: it differs from the config this command resumes with ({'; '.join(shown)}{more}); "
        "it is rewritten with this command's: a run's config is set by its command line, not by config.yaml"
    )


@dataclass(frozen=True)
class Resume:
    """What a launch resumes from: the run dir's complete checkpoints, newest first (the
    ranks pick the newest intact one once the process group is up, `choose_checkpoint`),
    and the damaged meta.json files met on the way."""

    candidates: list[Checkpoint]
    problems: list[str]


def check_resume(run_dir: Path, config: dict, *, restarted: bool = False) -> Resume | None:
    """Before any process group starts: the checkpoints this launch may resume from (None: a
    new run), or one ConfigError when the run dir cannot be started or resumed with this config.

    `restarted`: this launch is a torchrun restart of the job that made the run dir; if that
    job died before its first checkpoint, it starts again from step 0 (no candidates). The
    world size may differ from the checkpoint's (the config was validated for this one)."""
    if run_status(run_dir) == "completed":  # a damaged summary is rewritten by the resumed run
        raise ConfigError("run_dir", str(run_dir), "holds a completed run; choose a new run_dir")
    problems: list[str] = []
    found = complete_checkpoints(run_dir, problems)
    if not found:
        if restarted and not problems:
            return Resume(candidates=[], problems=[])
        if (run_dir / METRICS).exists():
            damaged = f" ({'; '.join(problems)})" if problems else ""
            raise ConfigError(
                "run_dir",
                str(run_dir),
                f"holds a run without a complete checkpoint to resume from{damaged}; choose a new run_dir",
            )
        return None
    newest = found[-1]
    config = resume_view(config)
    diff = first_difference(resume_view(newest.meta.get("config")), config)
    if diff:
        raise ConfigError(
            "run_dir", str(run_dir), f"holds a run with another config ({diff}); resume with the same settings"
        )
    if newest.meta.get("format") != FORMAT:
        raise ConfigError(
            "run_dir",
            str(run_dir),
            f"holds checkpoints of format {newest.meta.get('format', 1)}, this version reads format {FORMAT} "
            "(portable across world sizes); resume it with the version that wrote it (commit 0eae61f or "
            "earlier), or start a new run_dir",
        )

    # Older checkpoints of the same run are fallbacks only if they agree as well.
    def agrees(c: Checkpoint) -> bool:
        return c.meta.get("format") == FORMAT and not first_difference(resume_view(c.meta.get("config")), config)

    return Resume(candidates=[c for c in reversed(found) if agrees(c)], problems=problems)


def check_completed(run_dir: Path, config: dict) -> None:
    """For a sweep's completed job: one ConfigError unless the run dir's config.yaml is the
    config this job would run (as a resume compares them); a completed job is skipped only
    when it ran the settings asked for now."""
    recorded = read_yaml_mapping(run_dir / CONFIG)  # DamagedFile, naming it, when it cannot be read
    diff = first_difference(resume_view(recorded), resume_view(config))
    if diff:
        raise ConfigError(
            "run_dir",
            str(run_dir),
            f"holds a completed run with another config ({diff}); it is not run again: remove that run dir "
            "or give the sweep another sweep.dir",
        )


def damage(ckpt: Checkpoint, names: list[str]) -> list[str]:
    """What is wrong with these files of `ckpt` against its manifest ([] when they are intact)."""
    manifest, out = ckpt.meta.get("files") or {}, []
    for name in names:
        path, want = ckpt.path / name, manifest.get(name)
        if want is None:
            out.append(f"{ckpt.path.name}/{name} is not in its manifest")
        elif not path.is_file():
            out.append(f"{ckpt.path.name}/{name} is missing")
        elif path.stat().st_size != want["bytes"]:
            out.append(f"{ckpt.path.name}/{name} has {path.stat().st_size} bytes, its manifest says {want['bytes']}")
        elif file_digest(path) != want["sha256"]:
            out.append(f"{ckpt.path.name}/{name} does not match its SHA-256 checksum")
    return out


def choose_checkpoint(resume: Resume, *, world: dist.World) -> tuple[Checkpoint | None, list[str]]:
    """Collective: the newest candidate whose files are all intact, and what was wrong with the
    ones skipped. Each rank checks every world_size-th file of the manifest, so the ranks read
    the checkpoint once between them."""
    problems = list(resume.problems)
    for ckpt in resume.candidates:
        names = sorted(ckpt.meta.get("files") or {})
        if not names:  # every rank reads the same meta.json: no collective needed to agree
            problems.append(f"{ckpt.path.name}/meta.json has no file manifest")
            continue
        found = [p for ps in dist.gather_objects(damage(ckpt, names[world.rank :: world.world_size])) for p in ps]
        if not found:
            return ckpt, problems
        problems.extend(found)
    return None, problems


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, words, gauss_next = state["python"]
    random.setstate((version, tuple(words), gauss_next))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def read_portable(ckpt: Checkpoint) -> tuple[PortableState, list[dict]]:
    """The portable state of a checkpoint, put together from every rank's file, and the files'
    contents in rank order (their RNG streams and measurements)."""
    parts = [torch.load(ckpt.path / name, map_location="cpu", weights_only=True) for name in sorted(ckpt.meta["files"])]
    main = parts[0]
    if int(main["step"]) != ckpt.step:
        raise RuntimeError(f"checkpoint {ckpt.path} holds step {main['step']}, its meta.json says {ckpt.step}")
    model = {n: t for part in parts for n, t in part["model"].items()}
    optim = {key: {n: t for part in parts for n, t in part["optim"][key].items()} for key in main["optim"]}
    return PortableState(model, optim, main["scalars"], main["groups"]), parts


@dataclass(frozen=True)
class Loaded:
    """What a resume restored besides the model: this rank's saved measurements (None on another
    world size: they described other ranks) and an outer loop's state (None without one): its
    algorithm's state in plain coordinates ({"KEY/NAME": tensor}) and this rank's own window
    (None on another world size)."""

    measured: dict | None
    outer_state: dict[str, torch.Tensor] | None = None
    outer_window: dict | None = None


@torch.no_grad()
def load_checkpoint(
    ckpt: Checkpoint, *, strategy, optimizer: torch.optim.Optimizer, scheduler, world: dist.World, device, seed: int
) -> Loaded:
    """Collective: restore the model, the optimizer state and the lr schedule of step ckpt.step,
    cut for this rank by its strategy, on this world size or another."""
    state, parts = read_portable(ckpt)
    try:
        strategy.load_portable_state(optimizer, state)
    except (RuntimeError, KeyError, ValueError) as err:
        raise RuntimeError(
            f"checkpoint {ckpt.path} does not fit this run's model: {' '.join(str(err).split())[:400]} (a run "
            "resumes only with the model it was checkpointed with)"
        ) from err
    load_schedule(scheduler, parts[0]["scheduler"])
    same = ckpt.meta["world_size"] == world.world_size
    outer = _outer_state(parts) if "outer" in parts[0] else None
    window = parts[world.rank]["outer"]["window"] if same and outer is not None else None
    if same:
        _set_rng_state(parts[world.rank]["rng"], device)
        return Loaded(parts[world.rank].get("measured"), outer, window)
    _seed_streams(seed, rank=world.rank, step=ckpt.step, device=device)
    return Loaded(None, outer, window)


def _outer_state(parts: list[dict]) -> dict[str, torch.Tensor]:
    """The outer algorithm's state from every rank's share (a checkpoint written before the
    algorithms were plug-ins holds DiLoCo's momentum by bare name)."""
    out = {}
    for part in parts:
        saved = part["outer"]
        out.update(saved["state"] if "state" in saved else {f"momentum/{n}": t for n, t in saved["momentum"].items()})
    return out


def _seed_streams(seed: int, *, rank: int, step: int, device: torch.device) -> None:
    """This rank's RNG streams drawn anew from (seed, rank, step): a resume on another world
    size has no saved streams for its ranks."""
    words = np.random.SeedSequence([seed, rank, step]).generate_state(2)
    value = int(words[0]) << 32 | int(words[1])
    torch.manual_seed(value)
    np.random.seed(int(words[0]))
    random.seed(value)
    if device.type == "cuda":
        torch.cuda.manual_seed(value)
