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

The strategy is `SDPStrategy` with three parts of its own: the installer (the worker's groups,
and FSDP2 over each new subnetwork), the state mover (optimizer state unsharded and re-cut
into shards) and clipping's gradient scaling (each rank its own shards).

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
from sdp.subnet.apply import Subnet
from sdp.subnet.groups import rank_sets, ranks_of, sdp_dimension_sets
from sdp.subnet.install import Installed, Installer
from sdp.subnet.resample import HOST, place_state
from sdp.subnet.state import StateMover
from sdp.subnet.strategy import SDPStrategy
from sdp.subnet.sync import GradEntry, Piece


def scale_shards(trainable: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Clipping's scaling: each rank scales its own shards."""
    coef = torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)
    grads = [local(p.grad) for p in trainable if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))


class ShardedInstaller(Installer):
    """The installer of a worker of F ranks: the holder sets' groups per shard index, and FSDP2
    over every new subnetwork (one unit per block, then the root). FSDP takes contiguous
    parameters only and shards them by rows: cut columns keep the plain layout."""

    outer = False

    def __init__(self, plan, *, rank: int, device: torch.device, prepare, mesh, parallel, comm):
        super().__init__(plan, rank=rank, device=device, prepare=prepare)
        self.mesh, self.parallel, self.comm = mesh, parallel, comm
        self.shard = rank % plan.fsdp_degree

    def register(self, holder_sets) -> None:
        # The holder set of every worker, at shard index f, is the mesh's sdp-dimension group of
        # shard f: one communicator, not two. Then every rank takes part in creating every
        # other group, in the same order.
        f = self.plan.fsdp_degree
        if self.mesh["sdp"].size() > 1:
            everyone = sdp_dimension_sets(self.plan.workers, fsdp_degree=f)
            self.groups.adopt(everyone, rank=self.rank, group=self.mesh["sdp"].get_group())
        self.groups.add(rank_sets(holder_sets, fsdp_degree=f, replicated=bool(self.plan.replicated)))

    def finish(self, subnet: Subnet) -> list[GradEntry]:
        model, replicated, shard_dims = subnet.model, self.plan.replicated, self.plan.shard_dims
        names = {id(p): n for n, p in model.named_parameters()}
        ignored = {p for p in model.parameters() if names[id(p)] in replicated}

        def placement(p: nn.Parameter) -> Shard:
            dim = shard_dims.get(names[id(p)])
            return Shard(0 if dim is None else dim)

        mp = mixed_precision_policy(self.parallel)
        common = dict(mesh=self.mesh["fsdp"], mp_policy=mp, shard_placement_fn=placement, ignored_params=ignored)
        sharded = [
            fully_shard(block, reshard_after_forward=self.parallel.reshard_after_forward, **common)
            for _, block in blocks(model, family=self.plan.family)
        ]
        sharded.append(fully_shard(model, **common))
        for module in sharded:
            all_gather, reduce_scatter = counting_collectives(self.comm)
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)
        # fully_shard made new (DTensor) parameters: point the trainables and the sync at
        # them. A piece's dimension is never the sharded one, so its local coordinates
        # hold on the shard; a replicated piece is averaged over all ranks of its holders.
        params = dict(model.named_parameters())
        subnet.trainable = list(model.parameters())
        entries = []
        for e in subnet.grad_entries:
            shard = None if e.name in replicated else self.shard
            piece = Piece(params[e.name], e.piece.dim, e.piece.start, e.piece.length)
            holders = ranks_of(e.holders, shard, fsdp_degree=self.plan.fsdp_degree)
            entries.append(GradEntry(holders, e.kind, piece, e.name, e.full_dim, e.full_start))
        return entries


class ShardedStateMover(StateMover):
    """The state mover of a worker of F ranks: its optimizer state unsharded for the move, and
    the placed state cut into the shards FSDP gave the new parameters."""

    def view(self, installed: Installed, optimizer: torch.optim.Optimizer):
        # The worker's optimizer state, unsharded (collective within the worker, the same order
        # on its F ranks) onto the host, keyed by the parameters as they were before sharding.
        state = {}
        for name, p in installed.model.named_parameters():
            state[installed.params[name]] = {
                k: (v.full_tensor() if isinstance(v, DTensor) else v).to(HOST)
                for k, v in optimizer.state.get(p, {}).items()
            }
        return SimpleNamespace(param_groups=[{"params": list(state)}], state=state)

    def place(self, installed: Installed, optimizer: torch.optim.Optimizer, state: dict, scalars: dict) -> None:
        # One parameter at a time: its worker-level state is cut from the gathered full state,
        # then each rank keeps the shard FSDP gave it (the same placements as the parameter).
        params = dict(installed.model.named_parameters())
        by_name: dict[str, list] = {}
        for e in installed.subnet.grad_entries:
            by_name.setdefault(e.name, []).append(e)
        placed = {}
        for name, unsharded in installed.params.items():
            p = params[name]
            full = place_state(state, scalars, by_name[name], [unsharded])[unsharded]
            placed[p] = {k: shard_like(p, v) for k, v in full.items()}
        rebind(optimizer, installed.subnet.trainable, placed)


class ShardedSDPStrategy(SDPStrategy):
    """SDP over K = world / F workers, each sharding its subnetwork over F ranks with FSDP2."""

    scale_grads = staticmethod(scale_shards)

    def __init__(self, model: nn.Module, cfg, *, family: str, rank: int, world_size: int, parallel, **kwargs):
        """As `SDPStrategy`, but `world_size` is the world (K x F) and `parallel` the parallelism
        config (F = parallel.fsdp_degree); a `plan` is K workers' of F ranks."""
        f = parallel.fsdp_degree
        self.fsdp_degree, self.shard, self.parallel = f, rank % f, parallel
        self.mesh = sdp_dist.device_mesh(kwargs["device"].type, (world_size // f, f), ("sdp", "fsdp"))
        self.fsdp_mesh = self.mesh["fsdp"]
        super().__init__(model, cfg, family=family, rank=rank, world_size=world_size // f, **kwargs)
        # FSDP's policy casts the sharded weights to bf16; replicated ones (biases of held
        # neurons) stay fp32 and would meet bf16 activations: autocast casts them.
        if parallel.mixed_precision == "bf16" and self.plan.replicated:
            self.autocast_dtype = torch.bfloat16

    def _installer(self, prepare) -> Installer:
        return ShardedInstaller(
            self.plan,
            rank=self.rank,
            device=self.device,
            prepare=prepare,
            mesh=self.mesh,
            parallel=self.parallel,
            comm=self.comm,
        )

    def _mover(self, bucket_cap_mb: float) -> StateMover:
        return ShardedStateMover(
            self.assembly, rank=self.rank, comm=self.comm, bucket_cap_mb=bucket_cap_mb, device=self.device
        )

    def comm_groups(self) -> int:
        # The holder sets' groups of this rank's shard index (the mesh's sdp-dimension group
        # among them) and the mesh's fsdp-dimension group.
        return super().comm_groups() + (1 if self.fsdp_mesh.size() > 1 else 0)

    def describe(self) -> dict:
        replicated = sum(self.shapes[n].numel() for n in self.plan.replicated)
        return {
            **super().describe(),
            "fsdp_degree": self.fsdp_degree,
            "sdp_workers": self.plan.workers,
            "replicated_params": replicated,  # (full-model elements) kept whole on each rank of a worker
        }
