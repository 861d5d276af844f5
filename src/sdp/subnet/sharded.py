"""SDP x FSDP on a 2-D device mesh (`sdp` x `fsdp`): each SDP worker is a group of F ranks.

World size = K x F. Rank k*F + f is shard f of worker k: the K workers hold
subnetworks as in plain SDP (forward masking, neuron or block units), and the
F ranks of a worker shard that subnetwork with FSDP2 (one FSDP unit per
block, then the root), each on its own data.

Where FSDP cuts a tensor decides who can average with whom. A gradient is
first reduce-scattered (averaged) over the worker's F ranks by FSDP; then a
unit's piece of shard f must be averaged with the *same* piece on the other
holders. Holders keep a neuron chunk at different positions of their (smaller)
tensors, so every tensor is sharded along a dimension SDP does not slice:

- block units and shared tensors are whole, identical in shape on every
  worker: FSDP's default dim-0 shards;
- a tensor sliced along dim d > 0 (w2's columns, o_proj's heads): dim-0 shards,
  each of which holds all of its rows' held columns;
- a tensor sliced along dim 0 (w1's rows, q/k/v's heads): sharded along its
  largest other dimension that F divides evenly (FSDP2 pads dim 0 only);
- a 1-D sliced tensor (a bias or BatchNorm weight of held neurons), or one with
  no such dimension: replicated on the worker's F ranks (FSDP ignores it).

Then shard f of every piece sits at the same positions on every holder:
it is averaged over {h*F + f : h in holders}, a shared tensor's shard over
{k*F + f : every k}, and a replicated piece over all F ranks of its holders.
Each rank stores C/F of the units (plus the replicated biases) and 1/F of the
shared tensors.

Resampling works as under plain SDP, in worker coordinates: the worker's
optimizer state is gathered from its shards (collective within the worker)
before the holders exchange units, and the new subnetwork's state is cut, one
parameter at a time, into the shards FSDP gives the new parameters.

Backward masking keeps every full weight on every rank and trains views into
them, which FSDP's sharded parameters cannot host; it is refused before
launch.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from sdp import dist as sdp_dist
from sdp.dist import local
from sdp.models import blocks
from sdp.optim import rebind
from sdp.parallel.fsdp import counting_collectives, mixed_precision_policy, shard_like
from sdp.subnet.apply import named_tensors
from sdp.subnet.groups import rank_sets, ranks_of, sdp_dimension_sets
from sdp.subnet.resample import HOST, place_state
from sdp.subnet.strategy import SDPStrategy
from sdp.subnet.sync import GradEntry, Piece, Transfer


class ShardedSDPStrategy(SDPStrategy):
    """SDP over K = world / F workers, each sharding its subnetwork over F ranks with FSDP2."""

    def __init__(self, model: nn.Module, cfg, *, family: str, rank: int, world_size: int, parallel, **kwargs):
        """As `SDPStrategy`, but `world_size` is the world (K x F) and `parallel` the parallelism
        config (F = parallel.fsdp_degree); a `plan` is K workers' of F ranks."""
        f = parallel.fsdp_degree
        self.fsdp_degree, self.shard, self.family, self.parallel = f, rank % f, family, parallel
        self.mesh = sdp_dist.device_mesh(kwargs["device"].type, (world_size // f, f), ("sdp", "fsdp"))
        self.fsdp_mesh = self.mesh["fsdp"]
        super().__init__(model, cfg, family=family, rank=rank, world_size=world_size // f, **kwargs)
        # FSDP's policy casts the sharded weights to bf16; replicated ones (biases of held
        # neurons) stay fp32 and would meet bf16 activations: autocast casts them.
        if parallel.mixed_precision == "bf16" and self.replicated:
            self.autocast_dtype = torch.bfloat16

    def comm_groups(self) -> int:
        # The holder sets' groups of this rank's shard index (the mesh's sdp-dimension group
        # among them) and the mesh's fsdp-dimension group.
        return super().comm_groups() + (1 if self.fsdp_mesh.size() > 1 else 0)

    @property
    def worker(self) -> int:
        return self.rank // self.fsdp_degree

    @property
    def shard_dims(self) -> dict[str, int | None]:
        return self.plan.shard_dims

    @property
    def replicated(self) -> frozenset[str]:
        """Plain names of the parameters kept whole on each rank of a worker."""
        return self.plan.replicated

    def _ranks(self, workers: tuple[int, ...], shard: int | None) -> tuple[int, ...]:
        return ranks_of(workers, shard, fsdp_degree=self.fsdp_degree)

    def _register_groups(self, holder_sets) -> None:
        # The holder set of every worker, at shard index f, is the mesh's sdp-dimension group of
        # shard f: one communicator, not two. Then every rank takes part in creating every
        # other group, in the same order.
        if self.mesh["sdp"].size() > 1:
            everyone = sdp_dimension_sets(self.world_size, fsdp_degree=self.fsdp_degree)
            self.groups.adopt(everyone, rank=self.rank, group=self.mesh["sdp"].get_group())
        self.groups.add(rank_sets(holder_sets, fsdp_degree=self.fsdp_degree, replicated=bool(self.replicated)))

    def _finish_subnet(self) -> list[GradEntry]:
        names = {id(p): n for n, p in self.model.named_parameters()}
        ignored = {p for p in self.model.parameters() if names[id(p)] in self.replicated}

        def placement(p: nn.Parameter) -> Shard:
            dim = self.shard_dims.get(names[id(p)])
            return Shard(0 if dim is None else dim)

        self._unsharded = dict(self.model.named_parameters())  # the parameters grad_entries point at
        mp = mixed_precision_policy(self.parallel)
        common = dict(mesh=self.fsdp_mesh, mp_policy=mp, shard_placement_fn=placement, ignored_params=ignored)
        sharded = [
            fully_shard(block, reshard_after_forward=self.parallel.reshard_after_forward, **common)
            for _, block in blocks(self.model, family=self.family)
        ]
        sharded.append(fully_shard(self.model, **common))
        for module in sharded:
            all_gather, reduce_scatter = counting_collectives(self.comm)
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)
        # fully_shard made new (DTensor) parameters: point the trainables and the sync at
        # them. A piece's dimension is never the sharded one, so its local coordinates
        # hold on the shard; a replicated piece is averaged over all ranks of its holders.
        params = dict(self.model.named_parameters())
        self.subnet.trainable = list(self.model.parameters())
        entries = []
        for e in self.subnet.grad_entries:
            shard = None if e.name in self.replicated else self.shard
            piece = Piece(params[e.name], e.piece.dim, e.piece.start, e.piece.length)
            entries.append(GradEntry(self._ranks(e.holders, shard), e.kind, piece, e.name, e.full_dim, e.full_start))
        return entries

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        norm = self.sync.global_norm(rank=self.rank)
        coef = torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)
        grads = [local(p.grad) for p in self.subnet.trainable if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))  # each rank scales its own shards
        return norm

    def _optimizer_view(self, optimizer: torch.optim.Optimizer):
        # The worker's optimizer state, unsharded (collective within the worker, the same order
        # on its F ranks) onto the host, keyed by the parameters as they were before sharding.
        state = {}
        for name, p in self.model.named_parameters():
            state[self._unsharded[name]] = {
                k: (v.full_tensor() if isinstance(v, DTensor) else v).to(HOST)
                for k, v in optimizer.state.get(p, {}).items()
            }
        return SimpleNamespace(param_groups=[{"params": list(state)}], state=state)

    def _set_state(self, optimizer: torch.optim.Optimizer, state: dict, scalars: dict) -> None:
        # One parameter at a time: its worker-level state is cut from the gathered full state,
        # then each rank keeps the shard FSDP gave it (the same placements as the parameter).
        params = dict(self.model.named_parameters())
        by_name: dict[str, list] = {}
        for e in self.subnet.grad_entries:
            by_name.setdefault(e.name, []).append(e)
        placed = {}
        for name, unsharded in self._unsharded.items():
            p = params[name]
            full = place_state(state, scalars, by_name[name], [unsharded])[unsharded]
            placed[p] = {k: shard_like(p, v) for k, v in full.items()}
        rebind(optimizer, self.subnet.trainable, placed)

    def _local_tensors(self) -> dict[str, torch.Tensor]:
        # Collective within the worker: its F ranks gather every shard in the same order.
        return {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in named_tensors(self.model).items()}

    def _rank_space(self, transfers: list[Transfer]) -> list[Transfer]:
        # A worker's shard-0 rank sends for it (every rank of the worker has the gathered values).
        return [Transfer(t.source * self.fsdp_degree, t.numel, t.src, t.dst) for t in transfers]

    def describe(self) -> dict:
        replicated = sum(self.shapes[n].numel() for n in self.replicated)
        return {
            **super().describe(),
            "fsdp_degree": self.fsdp_degree,
            "sdp_workers": self.world_size,
            "replicated_params": replicated,  # (full-model elements) kept whole on each rank of a worker
        }
