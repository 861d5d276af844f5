"""Communication among holders: gradient averaging and the broadcasts of weight refresh,
assembly and resampling.

Gradients are averaged among a unit's holders only: all_reduce(SUM) over the
holder set's process group (`sdp.subnet.groups`), then division by the number
of holders.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sdp.dist import is_dtensor, local
from sdp.metrics.comm import CommCounter
from sdp.metrics.memory import allocating
from sdp.subnet.groups import HolderGroups


@dataclass(frozen=True)
class Piece:
    """A contiguous part of a local tensor: `tensor.narrow(dim, start, length)`, or all of it."""

    tensor: torch.Tensor
    dim: int | None
    start: int = 0
    length: int = 0

    def view(self, t: torch.Tensor | None = None) -> torch.Tensor:
        t = self.tensor if t is None else t
        return t if self.dim is None else t.narrow(self.dim, self.start, self.length)

    def wire(self, t: torch.Tensor | None = None) -> torch.Tensor:
        """The piece (of `t`) in the order its values travel: its sliced dimension first, then
        the others (row-major for a whole piece). Every rank sends and receives a piece in this
        order, whatever the layout it keeps the tensor in; the view is contiguous where the
        tensor keeps that dimension outermost (`sdp.subnet.layout.outer_layout`), so packing it
        costs nothing more than its share of one copy."""
        v = self.view(t)
        return v if self.dim in (None, 0) else v.movedim(self.dim, 0)

    @property
    def numel(self) -> int:
        return self.tensor.numel() if self.dim is None else self.view().numel()


def gather_flat(views: Sequence[torch.Tensor]) -> torch.Tensor:
    """The values of `views` one after another in a new flat buffer: one copy kernel when every
    view is contiguous. Strided views (cut columns in an FSDP shard, which keeps rows outermost)
    are not copied one by one: each run of consecutive views of one shape past their first
    dimension is one concatenation, which reads them in place, into its part of the buffer.
    The values only: no autograd history (a weight sent by a broadcast)."""
    views = [v.detach().reshape(1) if v.dim() == 0 else v.detach() for v in views]
    if all(v.is_contiguous() for v in views):
        return torch.cat([v.view(-1) for v in views])
    flat = torch.empty(sum(v.numel() for v in views), dtype=views[0].dtype, device=views[0].device)
    offset = 0
    for _, run in itertools.groupby(views, key=lambda v: tuple(v.shape[1:])):
        run = list(run)
        n = sum(v.numel() for v in run)
        torch.cat(run, out=flat.narrow(0, offset, n).view(-1, *run[0].shape[1:]))
        offset += n
    return flat


def copy_pairs(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """`dst.copy_(src)` for each pair (`src` flat, `dst` any view of as many elements): one
    multi-tensor copy over the contiguous destinations, one copy each for the others."""
    fast_d, fast_s = [], []
    for d, src in zip(dsts, srcs, strict=True):
        if d.is_contiguous():
            fast_d.append(d.view(-1))
            fast_s.append(src)
        else:
            d.copy_(src.view(d.shape))
    if fast_d:
        torch._foreach_copy_(fast_d, fast_s)


def tiled(pieces: Sequence[Piece], t: torch.Tensor) -> bool:
    """Whether `pieces` (of one tensor, sorted by start) cover `t` end to end along one dimension."""
    dim, end = pieces[0].dim, 0
    for piece in pieces:
        end = end + piece.length if piece.dim == dim and piece.start == end else -1
    return dim is not None and end == t.shape[dim]


def by_tensor(items: Sequence, piece: Callable = lambda item: item) -> list[list]:
    """`items` grouped by their piece's tensor (first seen, first), each group by start."""
    groups: dict[int, list] = {}
    for item in items:
        groups.setdefault(id(piece(item).tensor), []).append(item)
    return [sorted(group, key=lambda item: piece(item).start) for group in groups.values()]


def write_strided(pending: Sequence[tuple[Piece, torch.Tensor]]) -> None:
    """Write each flat average into its piece of `.grad` where that view is strided (a cut
    column of an FSDP shard). A gradient whose pieces here tile it is written whole by one
    concatenation of them, into its storage; any other piece is copied on its own."""
    for items in by_tensor(pending, piece=lambda item: item[0]):
        pieces = [piece for piece, _ in items]
        grad = local(pieces[0].tensor.grad)
        if grad.is_contiguous() and tiled(pieces, grad):
            dim = pieces[0].dim
            torch.cat([src.view(p.wire(grad).shape).movedim(0, dim) for p, src in items], dim=dim, out=grad)
            continue
        for piece, src in items:
            dst = piece.wire(grad)
            dst.copy_(src.view(dst.shape))


def norm_views(pieces: Sequence[Piece]) -> list[torch.Tensor]:
    """Dense tensors whose norms, squared and summed, are the squared norm of the gradients of
    `pieces`: a contiguous piece as it is; a strided tensor's pieces (cut columns of an FSDP
    shard) its whole gradient where they tile it, else copied into one buffer with the other
    such pieces (`gather_flat`: a concatenation a run of one shape)."""
    dense, strided = [], []
    for piece in pieces:
        view = piece.wire(local(piece.tensor.grad))
        if view.is_contiguous():
            dense.append(view)
        else:
            strided.append(piece)
    rest = []
    for group in by_tensor(strided):
        grad = local(group[0].tensor.grad)
        if tiled(group, grad):
            dense.append(grad)
        else:
            rest.extend(piece.wire(grad) for piece in group)
    if rest:
        dense.append(gather_flat(sorted(rest, key=lambda v: tuple(v.shape[1:]))))
    return dense


@dataclass(frozen=True)
class GradEntry:
    """A trainable piece, whose gradient is averaged over `holders`, and where it sits
    in the plain model: `name`, along `full_dim` (None: the whole tensor) from `full_start`."""

    holders: tuple[int, ...]
    kind: str  # comm counter label: grad_sync (units) | shared_sync (shared parameters)
    piece: Piece
    name: str
    full_dim: int | None = None
    full_start: int = 0


def split_by_size(items: list, *, numel: Callable, cap_elems: int):
    """Consecutive runs of `items` of at most cap_elems elements (an item larger than the cap is alone)."""
    bucket, size = [], 0
    for item in items:
        n = numel(item)
        if bucket and size + n > cap_elems:
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += n
    if bucket:
        yield bucket


# DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES): small, so the first
# all-reduce starts early in the backward.
FIRST_BUCKET_BYTES = 2**20


def _storage(t: torch.Tensor) -> int:
    """The identity of the storage `t` (its local part) views, for real, meta and fake tensors."""
    return local(t).untyped_storage()._cdata


def _local_numel(piece: Piece) -> int:
    """Elements of the piece this rank stores (of its shard, for an FSDP parameter)."""
    return piece.view(local(piece.tensor)).numel()


@dataclass(frozen=True)
class Bucket:
    """Gradient pieces of one holder set averaged by one all-reduce of a flat buffer.

    Every holder of the set builds the same buckets (the same pieces, in plain-model
    coordinates, in the same order), so their flat buffers line up entry for entry.
    """

    holders: tuple[int, ...]
    kind: str
    index: int  # its place among the buckets of (holders, kind)
    entries: tuple[GradEntry, ...]
    offsets: tuple[int, ...]  # of each entry in the flat buffer
    numel: int
    ready_at: int  # plain-model position of its first tensor: it is complete when that one's gradient is

    @property
    def order_key(self) -> tuple:
        """The bucket's place in the one launch order every rank shares. The backward
        produces gradients from the last tensor to the first, so a bucket whose earliest
        tensor comes later in the model is complete sooner."""
        return (-self.ready_at, len(self.holders), self.holders, self.kind, self.index)


def plan_buckets(
    entries: list[GradEntry],
    *,
    position: Mapping[str, int],
    cap_bytes: int,
    first_bytes: int = FIRST_BUCKET_BYTES,
    block: Mapping[str, int] | None = None,
) -> list[Bucket]:
    """Flat buckets of every holder set among `entries`, in launch order.

    A holder set's pieces are taken in the order the backward produces them (the reverse
    of `position`, a plain-model name's place in the plain model, the same on every rank)
    and cut into buckets of `first_bytes` (at most `cap_bytes`) for the first and
    `cap_bytes` for the others, as DDP does with its default cap. A bucket also ends where the backward leaves
    a block (`block`: a plain name's block index) once it holds a quarter of its cap: a
    holder set's pieces are spread through the depth, and a large tensor whose gradient is
    ready early (the LM head) must not wait for small ones of every layer (norm scales).
    The result is sorted by `Bucket.order_key`: every rank's list is the subsequence of one
    global order made of the holder sets it belongs to.
    """
    by_set: dict[tuple, list[GradEntry]] = {}
    for e in entries:
        by_set.setdefault((e.holders, e.kind), []).append(e)
    out = []
    for (holders, kind), members in by_set.items():
        members = sorted(members, key=lambda e: (-position[e.name], e.full_start))
        limits = (min(first_bytes, cap_bytes), cap_bytes)
        for index, bucket in enumerate(_cut(members, limits=limits, block=block or {})):
            sizes = [_local_numel(b.piece) for b in bucket]
            offsets = tuple(itertools.accumulate(sizes[:-1], initial=0))
            ready = min(position[b.name] for b in bucket)
            out.append(Bucket(holders, kind, index, tuple(bucket), offsets, sum(sizes), ready))
    return sorted(out, key=lambda b: b.order_key)


def _cut(members: list[GradEntry], *, limits: tuple[int, int], block: Mapping[str, int]):
    """Consecutive runs of `members` within the byte limits (first bucket, the others), ending
    early at a block boundary once a quarter full (see plan_buckets)."""
    bucket, size, limit = [], 0, limits[0]
    for e in members:
        nbytes = _local_numel(e.piece) * e.piece.tensor.element_size()
        leaving = bool(bucket) and block.get(e.name, -1) != block.get(bucket[-1].name, -1) and 4 * size >= limit
        if bucket and (size + nbytes > limit or leaving):
            yield bucket
            bucket, size, limit = [], 0, limits[1]
        bucket.append(e)
        size += nbytes
    if bucket:
        yield bucket


class GradSync:
    """Average each trainable piece's gradient over its holders, one flat all-reduce per bucket.

    Each entry's `piece.tensor` is a trainable parameter of this rank. With `overlap`, a
    post-accumulate-grad hook notes each tensor whose gradient the backward has made; a
    bucket whose tensors have all arrived is packed (its pieces copied into one flat buffer)
    at once, and its all-reduce is launched (asynchronously) once every bucket before it in
    this rank's launch order is launched: every rank issues its collectives in one global
    order (NCCL needs that across communicators). Calling the object waits for them all
    and writes the averages back into `.grad`. Without `overlap` (the reference) the same
    buckets are averaged after the backward, one at a time. Both give the same bits: the
    same buffers go through the same all-reduces.

    A tensor whose gradient lies wholly in buckets (and is not an FSDP shard) drops its
    `.grad` once all of its pieces are packed and gets it back from the averaged buckets,
    so the gradients are held once, not twice, while the all-reduces are in flight; a
    bucket's buffer exists only from its packing to its write-back.
    """

    def __init__(
        self,
        entries: list[GradEntry],
        *,
        groups: HolderGroups,
        comm: CommCounter,
        bucket_cap_mb: float,
        position: Mapping[str, int],
        block: Mapping[str, int] | None = None,
        overlap: bool = False,
    ):
        self.entries, self.groups, self.comm, self.overlap = entries, groups, comm, overlap
        plan = plan_buckets(entries, position=position, cap_bytes=int(bucket_cap_mb * 2**20), block=block)
        # A single holder's gradient is already its average: no bucket.
        self.buckets = [b for b in plan if groups.get(b.holders) is not None]
        self.active = True  # False on micro-batches before the last one of a step
        self.trace: list | None = None  # when a list: every launch as (holders, kind, index)
        self._tensors = {id(e.piece.tensor): e.piece.tensor for e in entries}
        self._slots: dict[int, list[int]] = {}  # tensor -> the buckets of its pieces, once per piece
        for i, b in enumerate(self.buckets):
            for e in b.entries:
                self._slots.setdefault(id(e.piece.tensor), []).append(i)
        self._movable = self._movable_tensors()
        self._hooks = []
        if overlap:
            self._hooks = [self._tensors[t].register_post_accumulate_grad_hook(self._on_grad) for t in self._slots]
        self._reset()

    def _movable_tensors(self) -> set[int]:
        """Tensors (by id) whose whole gradient is in buckets: plain tensors, covered by synced
        pieces, whose storage's other tensors are too. (Backward masking's held ranges of one
        weight share its storage, and one product makes the gradients of a run of them:
        `sdp.subnet.held`. That gradient is freed when every range drops its part, so either all
        drop theirs or none does.)"""
        covered: dict[int, int] = {}
        for b in self.buckets:
            for e in b.entries:
                covered[id(e.piece.tensor)] = covered.get(id(e.piece.tensor), 0) + _local_numel(e.piece)
        unsynced = {id(e.piece.tensor) for e in self.entries if self.groups.get(e.holders) is None}
        whole = {
            t
            for t, n in covered.items()
            if t not in unsynced and not is_dtensor(self._tensors[t]) and n == self._tensors[t].numel()
        }
        by_storage: dict[int, list[int]] = {}
        for t, tensor in self._tensors.items():
            by_storage.setdefault(_storage(tensor), []).append(t)
        return {t for t in whole if all(u in whole for u in by_storage[_storage(self._tensors[t])])}

    def _reset(self) -> None:
        self._flats: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._aliased = [False] * len(self.buckets)  # the flat buffer is a tensor's own gradient
        self._works: list = [None] * len(self.buckets)
        self._events: list = [None] * len(self.buckets)  # the estimator's timeline handles
        self._missing = [len(b.entries) for b in self.buckets]  # pieces whose gradient has not arrived
        self._unpacked = {t: len(slots) for t, slots in self._slots.items()}  # pieces not packed, by tensor
        self._hooked: set[int] = set()
        self._next = 0  # the next bucket to launch, in this rank's launch order
        self._strided: list[tuple[Piece, torch.Tensor]] = []  # averages bound for strided gradient views

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: pack the buckets p completes, launch what is ready."""
        if not self.active:
            return
        if id(p) in self._hooked:
            raise RuntimeError("a gradient was accumulated twice in one backward; overlapped averaging needs one")
        self._hooked.add(id(p))
        for i in self._slots[id(p)]:
            self._missing[i] -= 1
            if self._missing[i] == 0:
                self._pack(i)
        while self._next < len(self.buckets) and self._flats[self._next] is not None:
            self._launch(self._next)

    def _pack(self, i: int) -> None:
        """Gather bucket i's pieces into its flat buffer (one copy: `gather_flat`); a moved tensor
        whose pieces are all packed drops its `.grad`. A tensor no gradient reached contributes
        zeros, as under DDP. A bucket of one whole tensor (a large one, a block's, a shared one)
        whose order on the wire is its memory order is its gradient itself: averaged in place,
        with no copy that would double it in the backward."""
        b = self.buckets[i]
        whole = b.entries[0].piece.tensor
        if len(b.entries) == 1 and whole.grad is not None and b.numel == local(whole).numel():
            grad = local(whole.grad)
            wire = b.entries[0].piece.wire(grad)
            # Not a part of a larger gradient that the other parts free (a run of held ranges).
            alone = id(whole) not in self._movable or grad.untyped_storage().nbytes() == grad.nbytes
            if wire.is_contiguous() and alone:
                self._flats[i], self._aliased[i] = wire.view(-1), True
                self._unpacked[id(whole)] -= 1
                return
        views = []
        for e in b.entries:
            p = e.piece.tensor
            if p.grad is None:
                like = local(p)
                views.append(torch.zeros(_local_numel(e.piece), dtype=like.dtype, device=like.device))
            else:
                views.append(e.piece.wire(local(p.grad)))
        self._flats[i] = gather_flat(views)
        for e in b.entries:
            p = e.piece.tensor
            self._unpacked[id(p)] -= 1
            if self._unpacked[id(p)] == 0 and id(p) in self._movable and id(p) in self._hooked:
                p.grad = None  # its values are in the buckets; written back once averaged

    def _launch(self, i: int) -> None:
        b, flat = self.buckets[i], self._flats[i]
        self.comm.add(b.kind, flat.numel() * flat.element_size())
        self._works[i] = dist.all_reduce(flat, group=self.groups.get(b.holders), async_op=True)
        self._events[i] = self.comm.event("all_reduce", b.kind, flat.numel() * flat.element_size(), b.holders)
        if self.trace is not None:
            self.trace.append((b.holders, b.kind, b.index))
        self._next = i + 1

    def _write_back(self, i: int) -> None:
        """Wait for bucket i's all-reduce, divide by the holders and put the averages into `.grad`
        (one multi-tensor copy over the dense views: `copy_pairs`; strided ones at the end: `write_strided`)."""
        b, flat = self.buckets[i], self._flats[i]
        self._works[i].wait()
        self.comm.need(self._events[i])
        flat.div_(len(b.holders))
        if self._aliased[i]:  # the average is in .grad already
            self._flats[i] = None
            return
        with allocating("grads"):
            dsts, srcs = [], []
            for e, offset in zip(b.entries, b.offsets, strict=True):
                p = e.piece.tensor
                if p.grad is None:  # moved into the buckets
                    p.grad = torch.empty_like(p)
                dst, src = e.piece.wire(local(p.grad)), flat.narrow(0, offset, _local_numel(e.piece))
                if dst.is_contiguous():
                    dsts.append(dst.view(-1))
                    srcs.append(src)
                else:  # written once the step's buckets are in, a tensor at a time
                    self._strided.append((e.piece, src))
            copy_pairs(dsts, srcs)
        self._flats[i] = None

    def __call__(self) -> None:
        """Finish the step's averaging (collective); afterwards every `.grad` holds the average."""
        if self.overlap:
            for i in range(self._next, len(self.buckets)):  # buckets no hook completed
                if self._flats[i] is None:
                    self._pack(i)
                self._launch(i)
            for i in range(len(self.buckets)):
                self._write_back(i)
        else:
            for i in range(len(self.buckets)):
                self._pack(i)
                self._launch(i)
                self._write_back(i)
        write_strided(self._strided)
        self._reset()

    def global_norm(self, *, rank: int) -> torch.Tensor:
        """L2 norm of the whole model's averaged gradient: each piece counted once (by its first
        holder), in float64; one multi-tensor norm over this rank's pieces (`norm_views`), then
        one all-reduce."""
        device = local(self.entries[0].piece.tensor).device
        owned = norm_views([e.piece for e in self.entries if e.holders[0] == rank])
        if owned:
            norms = torch.stack(torch._foreach_norm(owned, 2, dtype=torch.float64))
            total = norms.dot(norms)
        else:
            total = torch.zeros((), dtype=torch.float64, device=device)
        dist.all_reduce(total)
        return total.sqrt()


@dataclass(frozen=True)
class Transfer:
    """Values that flow from rank `source` to every rank: `src` is the sender's piece
    (None on other ranks), `dst` where this rank writes them (None: keep what it
    has, e.g. a holder whose own copy is already current)."""

    source: int
    numel: int
    src: Piece | None
    dst: Piece | None
    name: str = ""  # the plain-model tensor the values belong to (weight refresh)
    site: int = -1  # the unit group they belong to (weight refresh: the forward waits per site)


def packed(transfers: Sequence[Transfer], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The sender's values of `transfers`, in order (each piece's wire order), in one new flat
    buffer of `dtype` on `device`."""
    if not transfers:
        return torch.empty(0, dtype=dtype, device=device)
    return gather_flat([t.src.wire() for t in transfers]).to(device=device, dtype=dtype)


def unpacked(flat: torch.Tensor, transfers: Sequence[Transfer]) -> None:
    """Write `flat` (the values of `transfers`, in order) where this rank keeps them: every
    transfer with a destination, in one multi-tensor copy (`copy_pairs`)."""
    dsts, srcs, offset = [], [], 0
    for t in transfers:
        if t.dst is not None:
            dsts.append(t.dst.wire())
            srcs.append(flat.narrow(0, offset, t.numel))
        offset += t.numel
    copy_pairs(dsts, srcs)


def broadcast_from_holders(
    transfers: list[Transfer],
    *,
    rank: int,
    comm: CommCounter | None,
    kind: str,
    bucket_cap_mb: float,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Send every transfer's values from its source rank to all ranks (one broadcast per bucket)."""
    by_source: dict[int, list[Transfer]] = {}
    for t in transfers:
        by_source.setdefault(t.source, []).append(t)
    cap = int(bucket_cap_mb * 2**20) // 4
    for src in sorted(by_source):
        for bucket in split_by_size(by_source[src], numel=lambda t: t.numel, cap_elems=cap):
            if rank == src:
                flat = packed(bucket, dtype=dtype, device=device)
                if comm is not None:
                    comm.add(kind, flat.numel() * flat.element_size())
            else:
                flat = torch.empty(sum(t.numel for t in bucket), dtype=dtype, device=device)
            dist.broadcast(flat, src=src)
            if comm is not None:
                world = tuple(range(dist.get_world_size()))
                comm.need(comm.event("broadcast", kind, flat.numel() * flat.element_size(), world))
            unpacked(flat, bucket)
