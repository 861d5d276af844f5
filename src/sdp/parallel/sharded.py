"""SDP x FSDP on a 2-D device mesh (`sdp` x `fsdp`): each SDP worker is a group of F ranks.

World size = K x F. Rank k*F + f is shard f of worker k: the K workers hold
subnetworks as in plain SDP, and the F ranks of a worker shard that
subnetwork with FSDP2 (one FSDP unit per block, then the root), each on its
own data. A gradient is first reduce-scattered (averaged) over the worker's F
ranks by FSDP; then shard f of a unit is averaged over the ranks that hold
shard f of it in the unit's holder workers, {h*F + f : h in holders}, and
shard f of a shared parameter over {k*F + f : every k}. Each rank stores C/F
of the model (plus the shared parameters / F).

Built for block-level forward masking: a held block has the same shapes on
every holder, so FSDP's dim-0 shard f is the same positions on every holder
and can be averaged positionally. Neuron-level masking keeps different units
in the same positions on different workers and needs per-chunk sharding; it
is refused before launch for now, as are backward masking and resampling.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from sdp import dist as sdp_dist
from sdp.metrics.memory import local
from sdp.parallel.fsdp import counting_collectives, mixed_precision_policy
from sdp.subnet.apply import named_tensors
from sdp.subnet.strategy import SDPStrategy
from sdp.subnet.sync import GradEntry, Piece, Transfer
from sdp.subnet.units import blocks


class ShardedSDPStrategy(SDPStrategy):
    """SDP over K = world / F workers, each sharding its subnetwork over F ranks with FSDP2."""

    def __init__(self, model: nn.Module, cfg, *, family: str, rank: int, world_size: int, parallel, **kwargs):
        f = parallel.fsdp_degree
        self.fsdp_degree, self.shard, self.family, self.parallel = f, rank % f, family, parallel
        self.fsdp_mesh = sdp_dist.device_mesh(kwargs["device"].type, (world_size // f, f), ("sdp", "fsdp"))["fsdp"]
        super().__init__(model, cfg, family=family, rank=rank, world_size=world_size // f, **kwargs)

    @property
    def worker(self) -> int:
        return self.rank // self.fsdp_degree

    def _ranks(self, workers: tuple[int, ...], shard: int) -> tuple[int, ...]:
        return tuple(w * self.fsdp_degree + shard for w in workers)

    def _register_groups(self, holder_sets) -> None:
        # Every rank takes part in creating every group, for every shard index.
        self.groups.add([self._ranks(hs, f) for hs in holder_sets for f in range(self.fsdp_degree)])

    def _finish_subnet(self) -> list[GradEntry]:
        mp = mixed_precision_policy(self.parallel)
        sharded = [
            fully_shard(
                block, mesh=self.fsdp_mesh, mp_policy=mp, reshard_after_forward=self.parallel.reshard_after_forward
            )
            for _, block in blocks(self.model, family=self.family)
        ]
        sharded.append(fully_shard(self.model, mesh=self.fsdp_mesh, mp_policy=mp))
        for module in sharded:
            all_gather, reduce_scatter = counting_collectives(self.comm)
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)
        # fully_shard made new (DTensor) parameters: point the trainables and the sync at them.
        # Block units and shared tensors are whole tensors: a shard of one is the same positions
        # on every holder (a sliced piece would not be, hence block granularity only).
        if any(e.piece.dim is not None for e in self.subnet.grad_entries):
            raise ValueError("SDP x FSDP needs whole-tensor units (masking.granularity=block, forward masking)")
        params = dict(self.model.named_parameters())
        self.subnet.trainable = list(self.model.parameters())
        return [
            GradEntry(self._ranks(e.holders, self.shard), e.kind, Piece(params[e.name], None), e.name)
            for e in self.subnet.grad_entries
        ]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        norm = self.sync.global_norm(rank=self.rank)
        coef = torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)
        grads = [local(p.grad) for p in self.subnet.trainable if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))  # each rank scales its own shards
        return norm

    def _local_tensors(self) -> dict[str, torch.Tensor]:
        # Collective within the worker: its F ranks gather every shard in the same order.
        return {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in named_tensors(self.model).items()}

    def _rank_space(self, transfers: list[Transfer]) -> list[Transfer]:
        # A worker's shard-0 rank sends for it (every rank of the worker has the gathered values).
        return [Transfer(t.source * self.fsdp_degree, t.numel, t.src, t.dst) for t in transfers]

    def describe(self) -> dict:
        return {**super().describe(), "fsdp_degree": self.fsdp_degree, "sdp_workers": self.world_size}
