"""The outer loop's syncs: each trained tensor's pseudo-gradient averaged over its holders, and an
outer Nesterov SGD step on theta_prev, every H steps per fragment.

For a tensor p this rank trains, with theta_prev (`backup`) and the outer momentum m kept on
`outer.backup_device`, a sync of p's fragment does:

    Delta   = theta_prev - p                       (this rank's pseudo-gradient)
    Delta_  = each piece's Delta averaged over the piece's holders (one all-reduce per bucket)
    theta_  = theta_prev - Delta_                  (the holders' mean of their local weights;
                                                    a piece with one holder: p itself)
    m       = momentum * m + Delta_
    u       = Delta_ + momentum * m                 (Nesterov, as torch.optim.SGD)
    p = theta_prev = theta_ + (Delta_ - lr * u)

which is theta_prev - lr * u, written as a step from the averaged point: with lr 1 and no
momentum the outer step adds exactly 0, so one worker (every piece a single holder's) runs the
plain run bit for bit. Pieces are cut into the buckets of `sdp.subnet.sync.plan_buckets`, whose
order is one global order over the holder sets; fragments sync in their own order, the same on
every rank, so the collectives of a sync need no other agreement.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from sdp.metrics.comm import CommCounter
from sdp.outer import OuterConfig
from sdp.outer.view import OuterView
from sdp.parallel import host as host_copy
from sdp.subnet.sync import Bucket, GradEntry, plan_buckets

WIRE = {"fp32": torch.float32, "bf16": torch.bfloat16}


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


class OuterLoop:
    """theta_prev and the outer momentum of this rank's trained tensors, and their syncs (collective)."""

    def __init__(
        self,
        cfg: OuterConfig,
        view: OuterView,
        *,
        device: torch.device,
        comm: CommCounter,
        max_steps: int,
        bucket_cap_mb: float,
    ):
        self.cfg, self.view, self.device, self.comm, self.max_steps = cfg, view, device, comm, max_steps
        self.home = torch.device("cpu") if cfg.backup_device == "cpu" else device
        self.wire = WIRE[str(cfg.comm_dtype)]
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
        self.momentum: dict[nn.Parameter, torch.Tensor] = {}
        self.syncs, self.sent = 0, 0  # fragment syncs done in this launch, and their bytes
        # When a list: every collective in issue order, as (holders, kind, (fragment, index)): the
        # start's broadcasts, the syncs' all-reduces and their refresh (on the world).
        self.trace: list | None = None

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
        of a unit start alike whatever their seeds; theta_prev is the start; the momentum is 0."""
        for f, buckets in enumerate(self.buckets):
            for b in buckets:
                flat = _pack(b, lambda p: p, dtype=b.entries[0].piece.tensor.dtype)
                dist.broadcast(flat, src=b.holders[0], group=self.view.group(b.holders))
                _unpack(flat, b, lambda p: p)
                if self.trace is not None:
                    self.trace.append((b.holders, "outer_start", (f, b.index)))
        self.view.refresh(lambda name: True)
        self.backup = {p: p.detach().to(self.home, copy=True) for p in self.view.trainable}
        if self.cfg.momentum > 0:
            self.momentum = {p: torch.zeros_like(t) for p, t in self.backup.items()}

    def after_step(self, step: int) -> None:
        """After optimizer step `step`: sync the fragments due (collective)."""
        for f in self.due(step):
            self.sync(f)

    @torch.no_grad()
    def sync(self, fragment: int) -> None:
        """Average the pseudo-gradients of `fragment` over their holders and take the outer step
        (collective: every rank syncs the same fragments in the same order)."""
        tensors = self.tensors[fragment]
        delta = {p: self.backup[p].to(self.device) - p for p in tensors}
        self._average(fragment, delta)
        lr, mu = self.cfg.lr, self.cfg.momentum
        for p in tensors:
            # With backup_device=device, `prev` and `m` are theta_prev and the momentum themselves
            # (no copy), updated in place.
            d, prev = delta.pop(p), self.backup[p].to(self.device)
            mean = prev.sub_(d)  # the holders' mean of their local weights
            for e in self.single.get(id(p), []):
                e.piece.view(mean).copy_(e.piece.view(p))
            u = d
            if mu > 0:
                m = self.momentum[p].to(self.device).mul_(mu).add_(d)
                u = d.add(m, alpha=mu)
                self.momentum[p].copy_(m)
            new = mean.add_(d.sub(u, alpha=lr))
            p.copy_(new)
            self.backup[p].copy_(new)
        if self.trace is not None:
            self.trace.append(("world", "outer_refresh", (fragment, self.syncs)))
        self.view.refresh(lambda name: self.fragment[name] == fragment)
        self.syncs += 1

    def _average(self, fragment: int, delta: dict[nn.Parameter, torch.Tensor]) -> None:
        """Each multi-holder piece of `delta` replaced by its mean over the piece's holders: every
        bucket's all-reduce issued (in `comm_dtype`), then each waited for and unpacked."""
        issued = []
        for b in self.buckets[fragment]:
            flat = _pack(b, lambda p: delta[p], dtype=self.wire)
            nbytes = flat.numel() * flat.element_size()
            self.comm.add("outer_sync", nbytes)
            self.sent += nbytes
            work = dist.all_reduce(flat, group=self.view.group(b.holders), async_op=True)
            issued.append((b, flat, work, self.comm.event("all_reduce", "outer_sync", nbytes, b.holders)))
            if self.trace is not None:
                self.trace.append((b.holders, "outer_sync", (fragment, b.index)))
        with self.comm.waiting():
            for b, flat, work, event in issued:
                work.wait()
                self.comm.need(event)
                _unpack(flat.float().div_(len(b.holders)), b, lambda p: delta[p])

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
        """Collective: the outer momentum in plain coordinates (the same on every rank: each unit's
        from its holders; theta_prev is the checkpoint's model, taken inside `synced()`), and what
        is this rank's alone between syncs: its local weights and its inner optimizer's state.
        (Its BatchNorm statistics are its own too, but only the ones evaluation reads count, and
        the checkpoint's model holds those: rank 0's under DDP, each unit's holder's under SDP.)"""
        momentum = self.view.gather({p: {"momentum": m} for p, m in self.momentum.items()}) if self.momentum else {}
        local = {"weights": [host_copy(p) for p in self.view.trainable], "inner": optimizer.state_dict()}
        return momentum.get("momentum", {}), local

    @torch.no_grad()
    def restore(self, optimizer: torch.optim.Optimizer, momentum: dict[str, torch.Tensor], local: dict | None) -> None:
        """A resumed run: theta_prev is the model as the checkpoint restored it, the momentum is cut
        from `momentum` (plain coordinates); `local` (a resume on the checkpoint's world size) puts
        back this rank's own weights and inner optimizer state, so that the window goes on as if
        never stopped."""
        self.backup = {p: p.detach().to(self.home, copy=True) for p in self.view.trainable}
        if self.cfg.momentum > 0:
            placed = self.view.place({"momentum": momentum})
            self.momentum = {p: placed[p]["momentum"].to(self.home) for p in self.view.trainable}
        if local is None:
            return
        for p, t in zip(self.view.trainable, local["weights"], strict=True):
            p.copy_(t)
        optimizer.load_state_dict(local["inner"])

    def device_state(self) -> list[torch.Tensor]:
        """theta_prev and the momentum where they count in the device's live peak: with
        outer.backup_device=device (with cpu they are host memory, reported apart)."""
        if self.cfg.backup_device != "device":
            return []
        return [*self.backup.values(), *self.momentum.values()]

    def first_sync(self, after: int) -> int | None:
        """The first step at or after `after` with a sync (None: none before the end)."""
        return next((s for s in range(max(after, 1), self.max_steps + 1) if self.due(s)), None)

    def memory(self) -> dict[str, int]:
        """Bytes of theta_prev and of the outer momentum on this rank (on `outer.backup_device`)."""
        return {
            "outer_backup_bytes": sum(t.numel() * t.element_size() for t in self.backup.values()),
            "outer_momentum_bytes": sum(t.numel() * t.element_size() for t in self.momentum.values()),
        }

    def figures(self) -> dict:
        """summary.json's `outer` entries."""
        return {
            "name": str(self.cfg.name),
            "sync_every": self.cfg.sync_every,
            "fragments": self.cfg.fragments,
            "lr": self.cfg.lr,
            "momentum": self.cfg.momentum,
            "comm_dtype": str(self.cfg.comm_dtype),
            "backup_device": str(self.home),
            "syncs": self.syncs,
            "bytes_per_sync": self.sent / self.syncs if self.syncs else None,
        }


def _pack(b: Bucket, source, *, dtype: torch.dtype) -> torch.Tensor:
    """A bucket's pieces of `source(tensor)` in one flat buffer of `dtype`, each copied into its
    place (no copy of a piece on the way: the buffer is a sync's only temporary per bucket)."""
    first = b.entries[0].piece.tensor
    flat = torch.empty(b.numel, dtype=dtype, device=source(first).device)
    for e, offset in zip(b.entries, b.offsets, strict=True):
        view = e.piece.view(source(e.piece.tensor))
        flat.narrow(0, offset, view.numel()).view(view.shape).copy_(view)
    return flat


def _unpack(flat: torch.Tensor, b: Bucket, target) -> None:
    """Copy a bucket's flat values into its pieces of `target(tensor)`."""
    for e, offset in zip(b.entries, b.offsets, strict=True):
        view = e.piece.view(target(e.piece.tensor))
        view.copy_(flat.narrow(0, offset, view.numel()).view(view.shape))
