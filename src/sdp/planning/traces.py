"""The planner's traces, kept on disk between calls.

A trace (`sdp.planning.estimator.estimate`) depends on the run's typed config, the world size,
the rank, where the head begins, and the code that runs it: this package and the versions of
torch and transformers. It does not depend on the devices, the cluster, the objective or how
many rows are shown. So re-planning the same run with other devices, another cluster or
objective, or `top=`, finds every trace it needs that an earlier call made: the step time is
computed from the trace's collectives on the cluster of the call, never stored.

Each trace is one JSON file named by the SHA-256 of its key (`key`), written whole under a
temporary name and renamed, so that the planner's worker processes, or two planners, never read
half a file. A file that cannot be read or does not match its key is traced anew. The default
folder is `$SDP_CACHE_DIR/traces`, else `$XDG_CACHE_HOME/sdp/traces`, else `~/.cache/sdp/traces`;
`sdp.plan cache=off` traces everything, `cache=DIR` keeps them in DIR. Changing a line of the
package's code starts an empty cache (the old files stay: delete the folder to reclaim them).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from importlib.metadata import version
from pathlib import Path

import torch

import sdp
from sdp.planning.estimates import Estimate
from sdp.run.config import RunConfig

FORMAT = 2  # the files' layout; a change of it starts an empty cache, like a change of the code


def default_dir() -> Path:
    """Where traces are kept unless `cache=` says otherwise (see the module doc)."""
    if os.environ.get("SDP_CACHE_DIR"):
        return Path(os.environ["SDP_CACHE_DIR"]) / "traces"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "sdp" / "traces"


def trace_now(cfg: RunConfig, *, world_size: int, rank: int, head: str | None = None) -> Estimate:
    """`sdp.planning.estimator.estimate`, its module imported at the first call: the tracing
    machinery (FakeTensor and its symbolic shapes, the FLOP counter, DTensor, FSDP, the training
    loop) takes about 0.9 s of imports that a call reading every trace back has no use for."""
    from sdp.planning.estimator import estimate  # deferred for its import time, not a cycle

    return estimate(cfg, world_size=world_size, rank=rank, head=head)


def steady_runs():
    """A `sdp.planning.estimator.SteadyRuns`, its module imported then (as `trace_now`)."""
    from sdp.planning.estimator import SteadyRuns  # deferred for its import time, not a cycle

    return SteadyRuns()


@functools.cache
def code_version() -> str:
    """A digest of everything besides the config that a trace depends on: the package's source
    files and the versions of torch and transformers."""
    digest = hashlib.sha256(f"{FORMAT} {torch.__version__} {version('transformers')}".encode())
    root = Path(sdp.__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def key(cfg: RunConfig, *, world_size: int, rank: int, head: str | None) -> str:
    """The text that names a trace: the typed config (its repr holds every field the run reads),
    the rank and world, the head, and the code's version."""
    return f"{code_version()}\n{world_size} {rank} {head}\n{cfg!r}"


class TraceCache:
    """`trace_now`, reading a trace made before from `root` and keeping each new one there;
    `root=None`: every call traces. `made` and `read` count this process's calls."""

    def __init__(self, root: Path | None):
        self.root = root
        self.made = self.read = 0
        self._steady = False
        self._runs = None  # a SteadyRuns while `steady` holds and a trace was made

    @contextlib.contextmanager
    def steady(self):
        """Inside, the traces this process makes keep their runs for the next (the estimator's
        `SteadyRuns`: a run traced again at another micro-batch skips its build and warm-up);
        made at the first trace, so a call that reads every trace back imports no tracing."""
        self._steady = True
        try:
            yield self
        finally:
            self._steady = False
            if self._runs is not None:
                self._runs.close()
                self._runs = None

    def __call__(self, cfg: RunConfig, *, world_size: int, rank: int, head: str | None = None) -> Estimate:
        if self.root is None:
            return self._trace(cfg, world_size=world_size, rank=rank, head=head)
        name = key(cfg, world_size=world_size, rank=rank, head=head)
        path = self.root / f"{hashlib.sha256(name.encode()).hexdigest()}.json"
        found = self._load(path, name)
        if found is not None:
            self.read += 1
            return found
        est = self._trace(cfg, world_size=world_size, rank=rank, head=head)
        self._store(path, name, est)
        return est

    def _trace(self, cfg: RunConfig, *, world_size: int, rank: int, head: str | None) -> Estimate:
        self.made += 1
        if not self._steady:
            return trace_now(cfg, world_size=world_size, rank=rank, head=head)
        if self._runs is None:
            self._runs = steady_runs()
        return self._runs(cfg, world_size=world_size, rank=rank, head=head)

    def __getstate__(self) -> dict:  # sent to the planner's workers: no runs travel
        return {**self.__dict__, "_steady": False, "_runs": None}

    @staticmethod
    def _load(path: Path, name: str) -> Estimate | None:
        try:
            entry = json.loads(path.read_text())
            if isinstance(entry, dict) and entry.get("key") == name:
                return Estimate.from_json(entry["estimate"])
        except (OSError, ValueError, TypeError, KeyError):
            pass  # unreadable, or not this trace: traced anew
        return None

    @staticmethod
    def _store(path: Path, name: str, est: Estimate) -> None:
        write_whole(path, json.dumps({"key": name, "estimate": est.to_json()}))


def write_whole(path: Path, text: str) -> None:
    """Write `text` under a temporary name, then rename it into place, so that no reader sees
    half a file; a cache that cannot be written is only slower, so an OSError is not the run's."""
    temporary = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(text)
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)
