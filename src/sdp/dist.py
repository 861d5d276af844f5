"""All distributed plumbing: world info, process group, device, rank-0 helpers.

This is the only module that reads the environment (torchrun's RANK /
WORLD_SIZE / LOCAL_RANK and the Hugging Face offline flags); everything else
receives a `World` and plain arguments.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# The job's store, kept for the roll call after a collective fails (it outlives the group).
_CONTROL: dist.Store | None = None


def dtensor_type() -> type | None:
    """torch's DTensor class, or None when torch.distributed.tensor was not imported (FSDP
    imports it): then no tensor is one. Asking imports nothing; that module alone is a fifth of
    `import sdp.train`'s time."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_dtensor(t: torch.Tensor) -> bool:
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's (FSDP's) local shard, or t itself."""
    return t._local_tensor if is_dtensor(t) else t


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_from_env() -> World:
    """Rank and world size as torchrun exports them; a plain `python -m` run is a world of one."""
    return World(
        rank=int(os.environ.get("RANK", 0)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
    )


def under_launcher() -> bool:
    """True inside a process torchrun (or a cluster task) started: the world is set already."""
    return "RANK" in os.environ


def export_world(*, rank: int, local_rank: int, world_size: int, local_world_size: int, addr: str, port: int):
    """Publish a world that a cluster scheduler (not torchrun) set up, as torchrun would."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(local_world_size),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def elastic_run_id() -> str | None:
    """The torchrun job's rendezvous id, the same in every attempt of a job; None outside
    torchrun or under the default id 'none', which many jobs share."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return run_id if run_id and run_id != "none" else None


def restart_count() -> int:
    """Which attempt of a torchrun job this is (0: the first; --max-restarts starts others)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def hub_offline() -> bool:
    """True when the user asked the Hugging Face libraries not to touch the network."""
    return any(
        os.environ.get(k, "0").lower() in ("1", "true", "yes") for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def select_device(preference: str, world: World, *, share: bool = False) -> torch.device:
    """`auto` takes this rank's GPU when CUDA is present, else the CPU. With `share` (gloo over
    CUDA tensors), ranks beyond the visible GPUs share them, local rank modulo their count
    (NCCL refuses two ranks on one device, gloo does not: a multi-rank test on one GPU)."""
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    index = world.local_rank % torch.cuda.device_count() if share else world.local_rank
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(
    world: World, *, backend: str, device: torch.device | None = None, timeout_s: float = 1800.0
) -> None:
    """Join the job's process group; a single process outside torchrun gets a group of one.

    `timeout_s` (parallelism.timeout_s) bounds every collective of every group, the ones
    made later included (SDP's holder sets, FSDP's mesh): a rank that stops responding
    makes the others fail after it instead of after torch's default (10 to 30 minutes).

    With NCCL on a known device the world communicator is made at once (`device_id`), and
    torch then splits every later group (SDP's holder sets) from it instead of bootstrapping
    a communicator of its own; every rank creates the groups in one order.

    Under torchrun every attempt of a job (--max-restarts) meets in the agent's store, which
    outlives the attempts; its keys are prefixed with the attempt, or a restarted rank can
    read the address a dead rank of the attempt before published and fail to connect (seen
    with gloo in 2 of 5 restarts, and one hang)."""
    global _CONTROL
    timeout = timedelta(seconds=timeout_s)
    # Groups made without a timeout of their own (by new_group, or a DeviceMesh) take torch's
    # default; it is this run's from here on.
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
    eager = {"device_id": device} if backend == "nccl" and device is not None and device.type == "cuda" else {}
    if "MASTER_ADDR" in os.environ or world.world_size > 1:
        meet = dist.rendezvous("env://", rank=world.rank, world_size=world.world_size, timeout=timeout)
        store, rank, size = next(meet)
    else:  # a process on its own: its store binds a port the kernel picks (none to race for)
        store, rank, size = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout), 0, 1
    prefix = f"sdp/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
    dist.init_process_group(
        backend=backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=size, timeout=timeout, **eager
    )
    _CONTROL = dist.PrefixStore(f"{prefix}/control", store)


# How a collective that lost a peer fails: gloo's timeouts and closed connections, NCCL's
# watchdog and aborted communicators.
_LOST_PEER = re.compile(r"timed out|timeout|connection (closed|reset)|broken pipe|communicator was aborted", re.I)
_PACKAGE = Path(__file__).resolve().parent


def failed_collective(err: BaseException) -> str | None:
    """When `err` is a collective that timed out or lost a peer: which collective, and where
    this package issued or waited for it ("all_reduce (from sdp.subnet.sync.GradSync.wait)");
    None for any other error."""
    frames = [frame for frame, _ in traceback.walk_tb(err.__traceback__)]
    api = next((f.f_code.co_name for f in frames if f.f_code.co_filename == c10d.__file__), None)
    message = str(err)
    lost = isinstance(err, dist.DistError) or (
        isinstance(err, RuntimeError) and _LOST_PEER.search(message) and (api or re.search("gloo|nccl", message, re.I))
    )
    if not lost:
        return None
    ours = [f for f in frames if Path(f.f_code.co_filename).resolve().is_relative_to(_PACKAGE)]
    ours = [f for f in ours if Path(f.f_code.co_filename).resolve() != Path(__file__).resolve()] or ours
    where = ""
    if ours:
        path = Path(ours[-1].f_code.co_filename).resolve().relative_to(_PACKAGE.parent).with_suffix("")
        where = f"{'.'.join(path.parts)}.{ours[-1].f_code.co_qualname}"
    if api:
        return f"{api} (from {where})" if where else api
    return f"a wait for a collective (in {where})" if where else "a collective"


def roll_call(world: World, *, wait_s: float) -> list[int] | None:
    """After a collective failed on this rank, through the job's store (no collective): report
    it, and wait up to `wait_s` for every other rank to report one too. Returns the ranks that
    reported (this one included), in order; None when the store cannot be reached."""
    if _CONTROL is None:
        return None
    keys = [f"failed/{r}" for r in range(world.world_size)]
    try:
        _CONTROL.set_timeout(timedelta(seconds=max(wait_s, 1.0)))
        _CONTROL.set(keys[world.rank], "1")
        deadline = time.monotonic() + wait_s
        while True:
            reported = [r for r, key in enumerate(keys) if _CONTROL.check([key])]
            if len(reported) == world.world_size or time.monotonic() >= deadline:
                return reported
            time.sleep(0.2)
    except (RuntimeError, dist.DistError):
        return None


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    dist.barrier()


def broadcast_object(obj, *, src: int = 0):
    """Send a picklable object from `src` to every rank (e.g. the run dir, decided once)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj) -> list:
    """`obj` from every rank, in rank order, on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
    dist.all_reduce(tensor, op=ops[op])
    return tensor


def rank() -> int:
    return dist.get_rank()


def world_size() -> int:
    return dist.get_world_size()


def warn0(world: World, message: str) -> None:
    """Rank 0 prints `warning: message` as one line on stderr, clear of the progress bar."""
    if world.is_main:
        from tqdm import tqdm

        tqdm.write(f"warning: {message}", file=sys.stderr)
        sys.stderr.flush()


def print0(world: World, *args, file=None) -> None:
    """Print on rank 0 (to stdout by default: the one at call time, so a test can capture it)."""
    if world.is_main:
        print(*args, file=file, flush=True)


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    """A process group in which this process plays `rank` of `world_size` and no collective
    moves data (the memory estimator: one process traces one rank of a K-worker job)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # init_process_group wraps sys.excepthook to prefix "[rankN]: " and never unwraps it: a
    # process that traces many ranks (the planner) would stack one prefix per group.
    hook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]):
    """A device mesh over all ranks (FSDP2's, and SDP x FSDP's later): this module owns them.

    A mesh is integer bookkeeping of ranks: it is made with real tensors even when the
    memory estimator traces under FakeTensorMode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh

    with unset_fake_temporarily():
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
