"""Resumable runs: per-rank checkpoints in the run dir, and the checks before a resume.

Layout: `RUN_DIR/checkpoints/step_00000120/` holds one `rank00003.pt` per rank
that owns distinct state, and `meta.json`, written by rank 0 last, after every
rank has written its file: a step dir without `meta.json` is incomplete and
ignored. Older complete checkpoints are removed once a newer one is complete
(`trainer.keep_checkpoints`).

Each rank saves what it holds, as plain local tensors: its model tensors (its
FSDP shards, its SDP subnetwork's held slices), its optimizer state, the lr
schedule, its RNG streams and the step. The data position and the mask epoch
follow from the step. A resume therefore needs the same config and world size
(checked before any process group starts) and restores every tensor in place,
so the resumed run continues bit for bit. Under DDP every rank holds the same
state: rank 0 alone writes it and every rank reads that file.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from sdp import dist
from sdp.errors import ConfigError
from sdp.metrics.logger import write_json_atomic
from sdp.metrics.memory import local

CHECKPOINTS = "checkpoints"


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    meta: dict


def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step_{step:08d}"


def complete_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """The run dir's complete checkpoints (those with meta.json), oldest first."""
    root = run_dir / CHECKPOINTS
    out = []
    for d in sorted(root.glob("step_*")) if root.is_dir() else []:
        meta = d / "meta.json"
        if d.is_dir() and meta.is_file():
            info = json.loads(meta.read_text())
            out.append(Checkpoint(int(info["step"]), d, info))
    return sorted(out, key=lambda c: c.step)


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def first_difference(a, b, prefix: str = "") -> str | None:
    """The first dotted key where two nested config containers differ, as 'key: old -> new'."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                return f"{prefix}{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}"
            diff = first_difference(a[key], b[key], f"{prefix}{key}.")
            if diff:
                return diff
        return None
    return None if a == b else f"{prefix.rstrip('.')}: {a!r} -> {b!r}"


def check_resume(run_dir: Path, config: dict, *, world_size: int) -> Checkpoint | None:
    """Before any process group starts: the checkpoint this launch resumes from (None: a new
    run), or one ConfigError when the run dir cannot be started or resumed with this config."""
    summary = run_dir / "summary.json"
    if summary.is_file() and json.loads(summary.read_text()).get("status") == "completed":
        raise ConfigError("run_dir", str(run_dir), "holds a completed run; choose a new run_dir")
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        if (run_dir / "metrics.jsonl").exists():
            raise ConfigError(
                "run_dir",
                str(run_dir),
                "holds a run without a complete checkpoint to resume from; choose a new run_dir",
            )
        return None
    diff = first_difference(ckpt.meta["config"], config)
    if diff:
        raise ConfigError(
            "run_dir", str(run_dir), f"holds a run with another config ({diff}); resume with the same settings"
        )
    if ckpt.meta["world_size"] != world_size:
        raise ConfigError(
            "run_dir",
            str(run_dir),
            f"was checkpointed with {ckpt.meta['world_size']} processes, this launch has {world_size}; "
            "resume with the same --nproc_per_node x nodes",
        )
    return ckpt


def _rng_state(device: torch.device) -> dict:
    """Every RNG stream of this process, as tensors and plain values (loadable with weights_only)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, words, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "python": [version, list(words), gauss_next],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, words, gauss_next = state["python"]
    random.setstate((version, tuple(words), gauss_next))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _to_local(obj):
    """Nested containers with every tensor replaced by this rank's local part, detached, on the host."""
    if isinstance(obj, torch.Tensor):
        return local(obj).detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_local(v) for v in obj)
    return obj


def _file(path: Path, rank: int) -> Path:
    return path / f"rank{rank:05d}.pt"


def save_checkpoint(
    run_dir: Path,
    *,
    step: int,
    strategy,
    optimizer: torch.optim.Optimizer,
    scheduler,
    world: dist.World,
    device: torch.device,
    config: dict,
    keep: int,
    measured: dict | None = None,
    extra_meta: dict | None = None,
) -> Path:
    """Write this rank's part of the checkpoint of `step` (collective: every rank calls it);
    `measured` is this rank's memory/FLOP measurements so far, which a resumed run keeps."""
    final = _step_dir(run_dir, step)
    tmp = final.with_name(final.name + ".partial")
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    if world.is_main or not strategy.replicated_state:
        state = {
            "step": step,
            "model": _to_local(strategy.model.state_dict()),
            "optimizer": _to_local(optimizer.state_dict()),
            "scheduler": scheduler.state_dict(),
            "rng": _rng_state(device),
            "measured": measured,
        }
        torch.save(state, _file(tmp, world.rank))
    if strategy.replicated_state and not world.is_main:
        # Replicated state, but not replicated RNG streams or measurements: each rank keeps its own.
        torch.save({"rng": _rng_state(device), "measured": measured}, _file(tmp, world.rank))
    dist.barrier()
    if world.is_main:
        meta = {"step": step, "world_size": world.world_size, "config": config, **(extra_meta or {})}
        write_json_atomic(tmp / "meta.json", meta)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old.path, ignore_errors=True)
    dist.barrier()
    return final


@torch.no_grad()
def load_checkpoint(
    ckpt: Checkpoint, *, strategy, optimizer: torch.optim.Optimizer, scheduler, world: dist.World, device
) -> dict | None:
    """Restore this rank's model tensors, optimizer state, lr schedule and RNG streams in place
    (to where they were after step ckpt.step); returns this rank's saved measurements."""
    owner = 0 if strategy.replicated_state else world.rank
    # weights_only: a checkpoint holds tensors and plain values only, so loading one never
    # runs code from the file.
    state = torch.load(_file(ckpt.path, owner), map_location="cpu", weights_only=True)
    own = torch.load(_file(ckpt.path, world.rank), map_location="cpu", weights_only=True)
    tensors = strategy.model.state_dict(keep_vars=True)
    if tensors.keys() != state["model"].keys():
        missing = sorted(set(tensors) ^ set(state["model"]))[:3]
        raise RuntimeError(f"checkpoint {ckpt.path} does not match this rank's model (e.g. {missing})")
    for name, t in tensors.items():
        local(t).copy_(state["model"][name])
    optimizer.load_state_dict(state["optimizer"])
    _shard_optimizer_state(optimizer)
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(own["rng"], device)
    if int(state["step"]) != ckpt.step:
        raise RuntimeError(f"checkpoint {ckpt.path} holds step {state['step']}, its meta.json says {ckpt.step}")
    return own.get("measured")


def _shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After load_state_dict: a sharded (DTensor) parameter's state back as DTensors like it."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            st = optimizer.state.get(p, {})
            for key, value in st.items():
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == local(p).shape:
                    st[key] = DTensor.from_local(
                        value.to(local(p).device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                    )


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop metrics.jsonl records of steps after `step` (a resumed run writes them again)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)
