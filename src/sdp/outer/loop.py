"""The outer loop's machinery: theta_prev, the windows and their syncs, of any outer algorithm.

For a tensor p this rank trains, with theta_prev (`backup`) kept on `outer.backup_device`, a sync
of p's fragment does:

    Delta   = theta_prev - p                       (this rank's pseudo-gradient)
    Delta_  = what the holders make of their Deltas (`exchange`, the algorithm's: DiLoCo's mean,
              SparseLoCo's mean of sparse ones; a piece with one holder keeps its own Delta)
    theta_  = theta_prev - Delta_                  (a piece with one holder: p itself)
    u       = the algorithm's direction from Delta_ (`direction`: DiLoCo's Nesterov momentum)
    p = theta_prev = theta_ + (Delta_ - lr * u)

which is theta_prev - lr * u, written as a step from theta_: with lr 1 and u = Delta_ the outer
step adds exactly 0, so one worker (every piece a single holder's) runs the plain run bit for
bit. Pieces are cut into the buckets of `sdp.subnet.sync.plan_buckets`, whose order is one global
order over the holder sets; fragments sync in their own order, the same on every rank, so the
collectives of a sync need no other agreement.

An algorithm gives its `OuterMethod`: `exchange`, `direction`, and its state: `state()`, the
same on every holder of a piece, is checkpointed in plain coordinates and cut again on any world
size; `own_state()`, this rank's alone, is saved in its window and restored on the same world
size only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from sdp.metrics.comm import CommCounter, wire_bytes
from sdp.outer.algorithms import OuterConfig
from sdp.outer.view import OuterView
from sdp.parallel import host as host_copy
from sdp.subnet.sync import Bucket, GradEntry, plan_buckets


def fragment_of(view: OuterView, fragments: int) -> dict[str, int]:
    """Each plain tensor's fragment: P groups of consecutive blocks (block b in b * P // blocks);
    a tensor in no block goes with the first fragment when it comes before the first block
    (embeddings, a stem), else with the last (a final norm, a head)."""
    in_block = [view.position[n] for n, b in view.block_of.items() if b >= 0]
    count = max(view.block_of.values()) + 1
    first = min(in_block) if in_block else 0
    out = {}
    for name, block in view.block_of.items():
        if block >= 0:
            out[name] = block * fragments // count
        else:
            out[name] = 0 if view.position[name] < first else fragments - 1
    return out


class OuterMethod:
    """An algorithm's part of a run's outer loop (see the module docstring): how the holders
    exchange their pseudo-gradients, the outer step's direction and lr, and the state it keeps.
    `loop` is the `OuterLoop` it serves (its buckets, view, counters and config)."""

    def __init__(self, loop: OuterLoop):
        self.loop, self.cfg = loop, loop.cfg
        self.lr = float(getattr(loop.cfg, "lr", 1.0))

    def exchange(self, fragment: int, delta: dict[nn.Parameter, torch.Tensor]) -> None:
        """Collective: replace each multi-holder piece of `delta` (this rank's pseudo-gradients of
        `fragment`'s tensors) by what its holders make of theirs, the same on every holder."""
        raise NotImplementedError

    def direction(self, p: nn.Parameter, d: torch.Tensor) -> torch.Tensor:
        """The outer step's direction for tensor `p` from its exchanged pseudo-gradient `d`."""
        return d

    def state(self) -> dict[str, dict[nn.Parameter, torch.Tensor]]:
        """Collective: the state kept per trained tensor, equal on a piece's holders, by name
        (DiLoCo's momentum): checkpointed in plain coordinates, cut again on any world size."""
        return {}

    def load_state(self, placed: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Take `state()` back, cut for this rank's tensors (no key: none saved, a new run)."""

    def own_state(self) -> dict:
        """What this rank keeps of its own besides its weights and inner optimizer, saved in its window."""
        return {}

    def load_own_state(self, own: dict) -> None:
        """Take `own_state()` back (a resume on the checkpoint's world size)."""

    def state_bytes(self) -> dict[str, int]:
        """Bytes of the algorithm's state on `outer.backup_device`, by name (outer_*_bytes)."""
        return {}

    def state_tensors(self) -> list[torch.Tensor]:
        """The algorithm's state tensors, counted in the device's live peak when they live there."""
        return []

    def knobs(self) -> dict:
        """summary.json's `outer` entries of the algorithm's own knobs."""
        return {}


class OuterLoop:
    """theta_prev of this rank's trained tensors and their syncs (collective); `method`, the
    algorithm's `OuterMethod` class, says how the holders exchange their pseudo-gradients and
    what it keeps (see the module docstring)."""

    def __init__(
        self,
        cfg: OuterConfig,
        view: OuterView,
        *,
        device: torch.device,
        comm: CommCounter,
        max_steps: int,
        bucket_cap_mb: float,
        method: type[OuterMethod],
    ):
        self.cfg, self.view, self.device, self.comm, self.max_steps = cfg, view, device, comm, max_steps
        self.home = torch.device("cpu") if cfg.backup_device == "cpu" else device
        self.fragment = frag = fragment_of(view, cfg.fragments)  # every plain tensor's, on every rank
        name = {id(e.piece.tensor): e.name for e in view.entries}
        self.tensors: list[list[nn.Parameter]] = [[] for _ in range(cfg.fragments)]
        for p in view.trainable:
            self.tensors[frag[name[id(p)]]].append(p)
        self.buckets: list[list[Bucket]] = []
        for f in range(cfg.fragments):
            mine = [e for e in view.entries if frag[e.name] == f]
            planned = plan_buckets(mine, position=view.position, cap_bytes=int(bucket_cap_mb * 2**20))
            self.buckets.append([b for b in planned if len(b.holders) > 1])
        self.single: dict[int, list[GradEntry]] = {}  # tensor -> its pieces with one holder
        for e in view.entries:
            if len(e.holders) == 1:
                self.single.setdefault(id(e.piece.tensor), []).append(e)
        self.backup: dict[nn.Parameter, torch.Tensor] = {}
        # Fragment syncs done in this launch, and their bytes: the collectives' payload, and what
        # one rank moves on the wire for it (`sdp.metrics.comm.wire_bytes`).
        self.syncs, self.sent, self.wired = 0, 0, 0.0
        # When a list: every collective in issue order, as (holders, kind, (fragment, index)): the
        # start's broadcasts, the syncs' exchanges and their refresh (on the world).
        self.trace: list | None = None
        self.method = method(self)

    def due(self, step: int) -> list[int]:
        """The fragments to sync after optimizer step `step`: fragment p every H steps, H / P steps
        after fragment p - 1; every fragment after the last step."""
        if step == self.max_steps:
            return list(range(self.cfg.fragments))
        every = self.cfg.sync_every // self.cfg.fragments
        return [] if step % every else [(step // every - 1) % self.cfg.fragments]

    @torch.no_grad()
    def start(self) -> None:
        """A new run (collective): every piece takes its first holder's values, so that the holders
        of a unit start alike whatever their seeds; theta_prev is the start; the state its zero."""
        for f, buckets in enumerate(self.buckets):
            for b in buckets:
                flat = pack(b, lambda p: p, dtype=b.entries[0].piece.tensor.dtype)
                dist.broadcast(flat, src=b.holders[0], group=self.view.group(b.holders))
                unpack(flat, b, lambda p: p)
                if self.trace is not None:
                    self.trace.append((b.holders, "outer_start", (f, b.index)))
        self.view.refresh(lambda name: True)
        self.backup = {p: p.detach().to(self.home, copy=True) for p in self.view.trainable}
        self.method.load_state({p: {} for p in self.view.trainable})

    def after_step(self, step: int) -> None:
        """After optimizer step `step`: sync the fragments due (collective)."""
        for f in self.due(step):
            self.sync(f)

    @torch.no_grad()
    def sync(self, fragment: int) -> None:
        """Exchange the pseudo-gradients of `fragment` among their holders and take the outer step
        (collective: every rank syncs the same fragments in the same order)."""
        tensors = self.tensors[fragment]
        delta = {p: self.backup[p].to(self.device) - p for p in tensors}
        self.method.exchange(fragment, delta)
        for p in tensors:
            # With backup_device=device, `prev` is theta_prev itself (no copy), updated in place.
            d, prev = delta.pop(p), self.backup[p].to(self.device)
            mean = prev.sub_(d)  # the holders' point (their mean of local weights, for DiLoCo)
            for e in self.single.get(id(p), []):
                e.piece.view(mean).copy_(e.piece.view(p))
            new = mean.add_(d.sub(self.method.direction(p, d), alpha=self.method.lr))
            p.copy_(new)
            self.backup[p].copy_(new)
        if self.trace is not None:
            self.trace.append(("world", "outer_refresh", (fragment, self.syncs)))
        self.view.refresh(lambda name: self.fragment[name] == fragment)
        self.syncs += 1

    def issued(self, op: str, nbytes: int, holders: tuple[int, ...], *, fragment: int, index: int):
        """Count a sync's collective of `nbytes` payload on this rank among `holders` (its bytes,
        its wire bytes, its trace entry); returns its handle on the estimator's timeline."""
        self.comm.add("outer_sync", nbytes)
        self.sent += nbytes
        self.wired += wire_bytes(op, nbytes, len(holders))
        if self.trace is not None:
            self.trace.append((holders, "outer_sync", (fragment, index)))
        return self.comm.event(op, "outer_sync", nbytes, holders)

    @contextlib.contextmanager
    def synced(self) -> Iterator[None]:
        """The trained tensors hold theta_prev, the last synced values, inside (this rank's own
        between syncs outside): what evaluation and a checkpoint's model see."""
        with torch.no_grad():
            local = {p: p.detach().to(self.home, copy=True) for p in self.view.trainable}
            for p in self.view.trainable:
                p.copy_(self.backup[p])
        try:
            yield
        finally:
            with torch.no_grad():
                for p, t in local.items():
                    p.copy_(t)

    @torch.no_grad()
    def checkpoint(self, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
        """Collective: the algorithm's `state()` in plain coordinates, as {"KEY/NAME": tensor} (the
        same on every rank: each unit's from its holders; theta_prev is the checkpoint's model, taken
        inside `synced()`), and what is this rank's alone between syncs: its local weights, its
        inner optimizer's state and the algorithm's `own_state()`. (Its BatchNorm statistics are
        its own too, but only the ones evaluation reads count, and the checkpoint's model holds
        those: rank 0's under DDP, each unit's holder's under SDP.)"""
        state = self.method.state()
        per_tensor: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        for key, tensors in state.items():
            for p, t in tensors.items():
                per_tensor.setdefault(p, {})[key] = t
        full = self.view.gather(per_tensor) if per_tensor else {}
        plain = {f"{key}/{name}": t for key, per_name in full.items() for name, t in per_name.items()}
        local = {
            "weights": [host_copy(p) for p in self.view.trainable],
            "inner": optimizer.state_dict(),
            "own": self.method.own_state(),
        }
        return plain, local

    @torch.no_grad()
    def restore(self, optimizer: torch.optim.Optimizer, plain: dict[str, torch.Tensor], local: dict | None) -> None:
        """A resumed run: theta_prev is the model as the checkpoint restored it, the state is cut
        from `plain` (`checkpoint`'s); `local` (a resume on the checkpoint's world size) puts back
        this rank's own weights, inner optimizer state and own state, so that the window goes on
        as if never stopped."""
        self.backup = {p: p.detach().to(self.home, copy=True) for p in self.view.trainable}
        full: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in plain.items():
            kind, _, name = key.partition("/")
            full.setdefault(kind, {})[name] = t
        self.method.load_state(self.view.place(full) if full else {p: {} for p in self.view.trainable})
        if local is None:
            return
        for p, t in zip(self.view.trainable, local["weights"], strict=True):
            p.copy_(t)
        optimizer.load_state_dict(local["inner"])
        self.method.load_own_state(local.get("own", {}))

    def device_state(self) -> list[torch.Tensor]:
        """theta_prev and the algorithm's state where they count in the device's live peak: with
        outer.backup_device=device (with cpu they are host memory, reported apart)."""
        if self.cfg.backup_device != "device":
            return []
        return [*self.backup.values(), *self.method.state_tensors()]

    def first_sync(self, after: int) -> int | None:
        """The first step at or after `after` with a sync (None: none before the end)."""
        return next((s for s in range(max(after, 1), self.max_steps + 1) if self.due(s)), None)

    def memory(self) -> dict[str, int]:
        """Bytes of theta_prev and of the algorithm's state on this rank (on `outer.backup_device`)."""
        backup = sum(t.numel() * t.element_size() for t in self.backup.values())
        return {"outer_backup_bytes": backup, **self.method.state_bytes()}

    def figures(self) -> dict:
        """summary.json's `outer` entries."""
        return {
            "name": str(self.cfg.name),
            "sync_every": self.cfg.sync_every,
            "fragments": self.cfg.fragments,
            **self.method.knobs(),
            "backup_device": str(self.home),
            "syncs": self.syncs,
            "bytes_per_sync": self.sent / self.syncs if self.syncs else None,
            "wire_bytes_per_sync": self.wired / self.syncs if self.syncs else None,
        }


def pack(b: Bucket, source, *, dtype: torch.dtype) -> torch.Tensor:
    """A bucket's pieces of `source(tensor)` in one flat buffer of `dtype`, each copied into its
    place (no copy of a piece on the way: the buffer is a sync's only temporary per bucket)."""
    first = b.entries[0].piece.tensor
    flat = torch.empty(b.numel, dtype=dtype, device=source(first).device)
    for e, offset in zip(b.entries, b.offsets, strict=True):
        view = e.piece.view(source(e.piece.tensor))
        flat.narrow(0, offset, view.numel()).view(view.shape).copy_(view)
    return flat


def unpack(flat: torch.Tensor, b: Bucket, target) -> None:
    """Copy a bucket's flat values into its pieces of `target(tensor)`."""
    for e, offset in zip(b.entries, b.offsets, strict=True):
        view = e.piece.view(target(e.piece.tensor))
        view.copy_(flat.narrow(0, offset, view.numel()).view(view.shape))
