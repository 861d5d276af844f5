"""SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky; arXiv 2508.15706): DiLoCo's windows, with each
worker's pseudo-gradient sent sparse and quantized, and an error feedback in place of the outer
momentum. After H inner steps, for each bucket of the pieces this rank holds with others
(`sdp.outer.loop`; the bucket's pieces end to end, cut into chunks of `chunk_size` entries, the
last one padded with zeros):

    e      = error_decay * e + Delta             (this worker's error feedback: its own)
    kept   = the k entries of each chunk of e largest in magnitude, k = ceil(density * chunk_size)
    q      = them quantized to `value_bits`: 2 or 8 bits are codes on a uniform grid of 2^bits
             levels, symmetric about 0 and scaled per chunk so that its largest kept magnitude is
             an end; 32 bits are the values themselves
    e      = e - q at the kept entries           (it keeps exactly what was not sent)
    Delta_ = the holders' q summed in rank order, / holders   (one all-gather per bucket)
    theta  = theta_prev - lr * Delta_            (`OuterLoop.sync`, with Delta_ as the direction)

A piece with one holder sends nothing, so nothing of it is compressed: its Delta_ is its own
Delta, and its error feedback stays 0. Under SDP a bucket's holders are a unit's, and its
all-gather runs in their group only.

A bucket's payload on each holder: the kept entries' indices within their chunk (int16 up to
32768 entries a chunk, int32 above), their values (2 bits: four codes a byte; 8: a byte; 32:
fp32) and one fp32 scale per chunk (2 and 8 bits), each section padded to 4 bytes (the values are
read back in place). An all-gather among n holders moves (n - 1) times it on the wire
(`sdp.metrics.comm.wire_bytes`), where DiLoCo's all-reduce moves 2(n - 1)/n of its dense one.

The error feedback is each worker's own. A resume on the checkpoint's world size restores it
exactly (the window's own state); on another one (at a sync boundary) every holder of a piece
starts from the mean of the old holders' error feedback, the update the old workers still owed
the model between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from sdp.errors import ConfigError
from sdp.outer.algorithms import OuterAlgorithm, OuterConfig, check_window, register
from sdp.outer.loop import OuterLoop, OuterMethod, pack, unpack

BITS = (2, 8, 32)
MAX_CHUNK = 2**20  # entries a chunk at most (its indices in 32 bits, a bucket padded to whole chunks)


@dataclass
class SparseLoCoConfig(OuterConfig):
    lr: float = 1.0  # the outer step's learning rate (alpha)
    density: float = 0.03  # the share of each chunk's entries sent, in (0, 1]
    value_bits: int = 2  # 2 or 8 (with a scale per chunk), or 32 (the values as they are)
    error_decay: float = 0.95  # beta: the error feedback's decay, in [0, 1]
    chunk_size: int = 4096  # entries a chunk (top-k is taken per chunk)


@dataclass(frozen=True)
class Layout:
    """A bucket's chunks and payload sections, the same on each of its holders."""

    numel: int  # the bucket's entries
    chunk: int  # entries a chunk
    k: int  # entries sent a chunk
    bits: int  # a value's bits

    @property
    def chunks(self) -> int:
        return -(-self.numel // self.chunk)

    @property
    def index_dtype(self) -> torch.dtype:
        return torch.int16 if self.chunk <= 2**15 else torch.int32

    @property
    def sections(self) -> tuple[int, int, int]:
        """Bytes of the indices, the values and the scales, each padded to 4."""
        sent = self.chunks * self.k
        index = sent * (2 if self.index_dtype == torch.int16 else 4)
        value = -(-sent * self.bits // 8)
        scale = 4 * self.chunks if self.bits < 32 else 0
        return _pad4(index), _pad4(value), scale

    @property
    def payload(self) -> int:
        return sum(self.sections)


def layout_of(numel: int, cfg: SparseLoCoConfig) -> Layout:
    """A bucket of `numel` entries under `cfg`: chunks of chunk_size entries (one of all of them
    when there are fewer), ceil(density * chunk) of each sent."""
    chunk = min(cfg.chunk_size, numel)
    return Layout(numel, chunk, min(chunk, math.ceil(cfg.density * chunk)), cfg.value_bits)


def _pad4(n: int) -> int:
    return -(-n // 4) * 4


def compress(layout: Layout, e: torch.Tensor) -> torch.Tensor:
    """The payload of `e` (fp32, `layout.chunks * layout.chunk` entries, the padding 0), and `e`
    left holding what was not sent (in place)."""
    chunks = e.view(layout.chunks, layout.chunk)
    index = chunks.abs().topk(layout.k, dim=1, sorted=False).indices
    kept = chunks.gather(1, index)
    codes, scale, sent = _quantize(kept, layout.bits)
    chunks.scatter_(1, index, kept.sub(sent))
    e.narrow(0, layout.numel, e.numel() - layout.numel).zero_()  # a padded entry sent as a code is no error
    sizes = layout.sections
    parts = [index.to(layout.index_dtype).view(-1).view(torch.uint8), codes, scale.view(-1).view(torch.uint8)]
    padded = [torch.nn.functional.pad(p, (0, size - p.numel())) for p, size in zip(parts, sizes, strict=True)]
    return torch.cat(padded)


def decode(layout: Layout, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A holder's payload back to the kept entries' indices (int64) and values (fp32), [chunks, k]."""
    index_bytes, value_bytes, scale_bytes = layout.sections
    sent = layout.chunks * layout.k
    width = 2 if layout.index_dtype == torch.int16 else 4
    index = payload.narrow(0, 0, sent * width).view(layout.index_dtype).long().view(layout.chunks, layout.k)
    values = payload.narrow(0, index_bytes, value_bytes)
    if layout.bits == 32:
        return index, values.view(torch.float32).view(layout.chunks, layout.k)
    scale = payload.narrow(0, index_bytes + value_bytes, scale_bytes).view(torch.float32).view(-1, 1)
    codes = _unpack_codes(values, layout.bits, sent).view(layout.chunks, layout.k)
    return index, _dequantize(codes, scale, layout.bits)


def _quantize(kept: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the codes as bytes, each chunk's scale, the values they stand for) of `kept` [chunks, k]."""
    if bits == 32:
        return kept.reshape(-1).view(torch.uint8), kept.new_empty(0), kept
    half = (2**bits - 1) / 2
    scale = kept.abs().amax(dim=1, keepdim=True).div_(half)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = kept.div(safe).add_(half).round_().clamp_(0, 2**bits - 1).to(torch.uint8)
    return _pack_codes(codes.view(-1), bits), scale, _dequantize(codes, scale, bits)


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    return codes.float().sub_((2**bits - 1) / 2).mul_(scale)


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """2-bit codes four to a byte, the first in the low bits (8-bit codes as they are)."""
    if bits == 8:
        return codes
    quads = torch.nn.functional.pad(codes, (0, -codes.numel() % 4)).view(-1, 4)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=codes.device)
    return quads.bitwise_left_shift(shifts).sum(dim=1, dtype=torch.uint8)


def _unpack_codes(values: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    if bits == 8:
        return values.narrow(0, 0, count)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=values.device)
    return values.view(-1, 1).bitwise_right_shift(shifts).bitwise_and_(3).view(-1).narrow(0, 0, count)


class SparseLoCoMethod(OuterMethod):
    """The holders' mean of their sparse, quantized pseudo-gradients; each worker's error feedback."""

    def __init__(self, loop: OuterLoop):
        super().__init__(loop)
        cfg = self.cfg
        # By (fragment, place among its buckets): each bucket's layout, and its error feedback (padded).
        self.layouts = {
            (f, j): layout_of(b.numel, cfg) for f, buckets in enumerate(loop.buckets) for j, b in enumerate(buckets)
        }
        self.errors: dict[tuple[int, int], torch.Tensor] = {}

    def exchange(self, fragment: int, delta: dict[nn.Parameter, torch.Tensor]) -> None:
        """Every bucket's payload all-gathered among its holders (all issued, then each waited for),
        then each holder's values summed in rank order into the bucket's pieces of `delta`."""
        loop, issued = self.loop, []
        for j, b in enumerate(loop.buckets[fragment]):
            layout, key = self.layouts[(fragment, j)], (fragment, j)
            flat = pack(b, lambda p: delta[p], dtype=torch.float32)
            e = self.errors[key].to(flat.device)  # with backup_device=device: the state itself
            e.mul_(self.cfg.error_decay).narrow(0, 0, layout.numel).add_(flat)
            payload = compress(layout, e)
            if e is not self.errors[key]:  # backup_device=cpu on an accelerator: back to the host
                self.errors[key].copy_(e)
            gathered = payload.new_empty(len(b.holders) * payload.numel())
            event = loop.issued("all_gather", payload.numel(), b.holders, fragment=fragment, index=b.index)
            work = dist.all_gather_single(gathered, payload, group=loop.view.group(b.holders), async_op=True)
            issued.append((b, layout, gathered, work, event))
        with loop.comm.waiting():
            for b, layout, gathered, work, event in issued:
                work.wait()
                loop.comm.need(event)
                total = torch.zeros(layout.chunks, layout.chunk, dtype=torch.float32, device=gathered.device)
                for part in gathered.view(len(b.holders), -1):  # the group's rank order
                    index, values = decode(layout, part)
                    total.scatter_add_(1, index, values)
                mean = total.view(-1).narrow(0, 0, layout.numel).div_(len(b.holders))
                unpack(mean, b, lambda p: delta[p])

    @torch.no_grad()
    def state(self) -> dict[str, dict[nn.Parameter, torch.Tensor]]:
        """Collective: each piece's error feedback averaged over its holders (one all-reduce per
        bucket, in the syncs' order), in this rank's tensors (0 where a piece has one holder)."""
        loop = self.loop
        out = {p: torch.zeros_like(p, device=loop.home) for p in loop.view.trainable}
        for f, buckets in enumerate(loop.buckets):
            for j, b in enumerate(buckets):
                layout, e = self.layouts[(f, j)], self.errors[(f, j)]
                flat = e.narrow(0, 0, layout.numel).to(loop.device, copy=True)
                dist.all_reduce(flat, group=loop.view.group(b.holders))
                unpack(flat.div_(len(b.holders)), b, lambda p: out[p])
        return {"error_feedback": out}

    def load_state(self, placed: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """A new run's error feedback: 0; a resumed run's: the holders' mean it was saved as."""
        home = self.loop.home
        for f, buckets in enumerate(self.loop.buckets):
            for j, b in enumerate(buckets):
                layout = self.layouts[(f, j)]
                error = torch.zeros(layout.chunks * layout.chunk, dtype=torch.float32, device=home)
                if all("error_feedback" in placed[entry.piece.tensor] for entry in b.entries):
                    saved = pack(b, lambda p: placed[p]["error_feedback"], dtype=torch.float32)
                    error.narrow(0, 0, layout.numel).copy_(saved)
                self.errors[(f, j)] = error

    def own_state(self) -> dict:
        return {"error_feedback": [e.detach().to("cpu", copy=True) for e in self.errors.values()]}

    def load_own_state(self, own: dict) -> None:
        for e, saved in zip(self.errors.values(), own["error_feedback"], strict=True):
            e.copy_(saved)

    def state_bytes(self) -> dict[str, int]:
        return {"outer_error_feedback_bytes": sum(e.numel() * e.element_size() for e in self.errors.values())}

    def state_tensors(self) -> list[torch.Tensor]:
        return list(self.errors.values())

    def knobs(self) -> dict:
        cfg = self.cfg
        return {
            "lr": cfg.lr,
            "density": cfg.density,
            "value_bits": cfg.value_bits,
            "error_decay": cfg.error_decay,
            "chunk_size": cfg.chunk_size,
        }


class SparseLoCo(OuterAlgorithm):
    """SparseLoCo's knobs and checks; its loop: `SparseLoCoMethod` over `OuterLoop`."""

    name, title, schema = "sparseloco", "SparseLoCo", SparseLoCoConfig
    caveat = "SparseLoCo: no converged comparison yet"

    def details(self, knobs: dict) -> list[str]:
        """The density and the value bits: "SparseLoCo(H=10, 3%, 2-bit)"."""
        if "density" not in knobs:
            return []
        return [f"{100 * knobs['density']:g}%", f"{knobs['value_bits']}-bit"]

    def validate(self, cfg) -> None:
        check_window(cfg)
        if not (math.isfinite(cfg.lr) and cfg.lr > 0):
            raise ConfigError("outer.lr", cfg.lr, "must be a finite number > 0 (SparseLoCo's: 1)")
        if not (math.isfinite(cfg.density) and 0 < cfg.density <= 1):
            raise ConfigError("outer.density", cfg.density, "must be in (0, 1]: the share of each chunk sent")
        if cfg.value_bits not in BITS:
            raise ConfigError("outer.value_bits", cfg.value_bits, "allowed: 2, 8 (a scale per chunk), 32 (fp32)")
        if not (math.isfinite(cfg.error_decay) and 0 <= cfg.error_decay <= 1):
            raise ConfigError("outer.error_decay", cfg.error_decay, "must be in [0, 1] (0: no error feedback)")
        if not 1 <= cfg.chunk_size <= MAX_CHUNK:
            raise ConfigError("outer.chunk_size", cfg.chunk_size, f"must be in [1, {MAX_CHUNK}] (entries a chunk)")

    def build(self, cfg, view, *, device, comm, max_steps: int, bucket_cap_mb: float) -> OuterLoop:
        cap, method = bucket_cap_mb, SparseLoCoMethod
        return OuterLoop(cfg, view, device=device, comm=comm, max_steps=max_steps, bucket_cap_mb=cap, method=method)


register(SparseLoCo())
