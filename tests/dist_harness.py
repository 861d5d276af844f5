"""Multi-process SDP checks: tests/conftest.py's `run_harness` runs `main([SCENARIO, OUT.json])` on
forked ranks (tests/ranks.py); by hand, `python -m torch.distributed.run --nproc_per_node=K
tests/dist_harness.py SCENARIO OUT.json`. Every rank measures; rank 0 writes what the test
asserts on. Measurements, not verdicts: the assertions live in the test.

What runs is the product's: each check's strategy is built by `sdp.run.build.build_strategy` from a
command line (`overrides`) that `sdp.run.config` composes and checks, and steps through the
trainer's `train_step`. The harness keeps only what a test observes: the batches, the byte
counters, the recorded collectives and predictions from the mask.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import sys

import torch
import torch.distributed as dist
from conftest import TINY_MODELS, tiny_model_cfg
from torch.nn.parallel import DistributedDataParallel

from sdp.dist import World, broadcast_object, local
from sdp.metrics.comm import CommCounter
from sdp.models import build_model, computes_loss
from sdp.optim import OptimConfig, build_optimizer
from sdp.run.build import build_strategy
from sdp.run.config import load_config
from sdp.run.measure import PhaseTimer
from sdp.run.trainer import forward_loss, train_step
from sdp.run.trainer_config import TrainerConfig
from sdp.subnet import MaskingConfig
from sdp.subnet.capacity import listed
from sdp.subnet.resample import gather_state
from sdp.subnet.strategy import SDPStrategy

CPU = torch.device("cpu")


def batch(family: str, rank: int, step: int, n: int = 4) -> dict:
    """A deterministic batch per (rank, step): every process can recompute any rank's batch."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    if family == "llama":
        tokens = torch.randint(0, 4096, (n, 17), generator=g)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    return {"inputs": torch.randn(n, 3, 32, 32, generator=g), "targets": torch.randint(0, 10, (n,), generator=g)}


def overrides(
    family: str,
    masking: MaskingConfig | None,
    *,
    ac: str = "none",
    fsdp: bool = False,
    fsdp_degree: int = 1,
    overlap: bool = True,
    autocast: torch.dtype | None = None,
    loss_chunk: int | None = None,
    compile_backend: str | None = None,
) -> list[str]:
    """The command line of a run of this check: the family's tiny model on the CPU, 1 MiB buckets,
    DDP (`masking=None`), FSDP or SDP. A LLaMA computes its loss itself, whole (`model.loss=full`)
    or `loss_chunk` tokens at a time."""
    model, dataset = TINY_MODELS[family]
    keys = {"model": model, "dataset": dataset, "seed": 0, "trainer.device": "cpu"}
    keys |= {
        "parallelism": "fsdp" if fsdp else "ddp",
        "parallelism.bucket_cap_mb": 1,
        "parallelism.fsdp_degree": fsdp_degree,
    }
    keys |= {"parallelism.activation_checkpointing": ac, "parallelism.overlap_comm": str(overlap).lower()}
    keys["parallelism.mixed_precision"] = "fp32" if autocast is None else "bf16"
    keys["parallelism.compile"] = str(compile_backend is not None).lower()
    if compile_backend is not None:
        keys["parallelism.compile_backend"] = compile_backend
    keys["masking"] = "none" if masking is None else masking.name
    if masking is not None:
        keys |= {f"masking.{k}": getattr(masking, k) for k in ("granularity", "coverage", "resample_every")}
    if masking is not None and masking.capacity is not None:  # the capacities' mean is the coverage
        del keys["masking.coverage"]
        keys["masking.capacity"] = listed(masking.capacity)
    if family == "llama":
        keys["model.loss"] = "full" if loss_chunk is None else "chunked"
        keys["model.loss_chunk_tokens"] = loss_chunk or 1024
    return [f"{k}={v}" for k, v in keys.items()]


@functools.cache  # bytes, not the config: every caller unpickles a copy of its own to build from
def _composed(line: tuple[str, ...], world_size: int) -> bytes:
    return pickle.dumps(load_config(list(line), world_size=world_size, offline=True, check_data=False))


def run_config(line: list[str]):
    """The typed, checked config of `line` for this job's world: composed once per job, by rank 0
    (Hydra's compose is most of a strategy's build time here), and sent to every rank (collective)."""
    blob = _composed(tuple(line), dist.get_world_size()) if dist.get_rank() == 0 else None
    return pickle.loads(broadcast_object(blob))


def make(family: str, masking: MaskingConfig | None, comm: CommCounter, **options):
    """The strategy a run of `overrides(family, masking, **options)` trains, built as the
    entrypoint builds it (config composed and checked by `sdp.run.config`, then `sdp.run.build`)."""
    cfg = run_config(overrides(family, masking, **options))
    world = World(rank=dist.get_rank(), local_rank=dist.get_rank(), world_size=dist.get_world_size())
    return build_strategy(cfg, world=world, device=CPU, comm=comm)


def worker_batch(family: str, worker: int, step: int, fsdp_degree: int = 2) -> dict:
    """The batches of a worker's `fsdp_degree` ranks in an SDP x FSDP job, as one batch."""
    parts = [batch(family, worker * fsdp_degree + f, step) for f in range(fsdp_degree)]
    return {k: torch.cat([b[k] for b in parts]) for k in parts[0]}


def train(strategy, family: str, *, steps: int, optimizer=None, first: int = 0, batches=batch, optim=None):
    """`steps` optimizer steps (numbered from `first`) of the trainer's own train_step, without
    clipping or the NaN/Inf check, then a resample where the mask asks for one, as the loop
    does; with a new optimizer (AdamW unless `optim` says otherwise) unless one is given.
    `batches(family, rank, step)` gives each rank's batch."""
    optim = optim or OptimConfig(lr=1e-3, weight_decay=0.1)
    optimizer = optimizer or build_optimizer(strategy.trainable(), optim)
    rank = dist.get_rank()
    cfg = TrainerConfig(grad_clip=0.0, on_nonfinite="off")
    strategy.model.train()
    for step in range(first, first + steps):
        whole = batches(family, rank, step)
        micro = whole["targets"].shape[0]
        train_step(strategy, optimizer, iter([whole]), cfg=cfg, micro=micro, device=CPU, timer=PhaseTimer(CPU))
        if step + 1 < first + steps and strategy.resample(step + 1, optimizer):  # as the trainer does
            strategy.model.train()
    return optimizer


def gathered(x):
    """`x` from every rank, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    return max((a[k].detach() - b[k].detach()).abs().max().item() for k in a)


def max_rel_diff(a: dict, b: dict) -> float:
    """The largest per-tensor difference relative to the reference tensor's largest entry."""
    assert a.keys() == b.keys(), set(a) ^ set(b)
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)).item() for k in a)


def equivalence() -> dict:
    """C = 1: every SDP variant against DDP, parameters after a few steps."""
    out = {}
    for family in TINY_MODELS:
        ddp = make(family, None, CommCounter())
        train(ddp, family, steps=3)
        ref = {k: v.clone() for k, v in ddp.full_parameters().items()}
        out[family] = {}
        for mode in ("backward", "forward"):
            for gran in ("neuron", "block"):
                sdp = make(family, MaskingConfig(name=mode, granularity=gran, coverage=1.0), CommCounter())
                train(sdp, family, steps=3)
                out[family][f"{mode}-{gran}"] = max_diff(ref, sdp.full_parameters())
    return out


def stacking() -> dict:
    """K = 2: FSDP2 against DDP, and activation checkpointing against none, after 3 AdamW steps."""
    out = {}
    for family in TINY_MODELS:
        res = out[family] = {}
        ddp = make(family, None, CommCounter())
        train(ddp, family, steps=3)
        ref = {k: v.detach().clone() for k, v in ddp.full_parameters().items()}
        comm = CommCounter()
        fsdp = make(family, None, comm, fsdp=True)
        optimizer = train(fsdp, family, steps=3)
        res["fsdp_rel"] = max_rel_diff(fsdp.full_parameters(), ref)
        sent = comm.end_step()  # three steps' worth
        # FSDP2 gives rank r the r-th torch.chunk of dim 0 of every parameter, stored (with its
        # gradient) padded to ceil(rows / K) rows; AdamW's state is made like the unpadded shard.
        k, rank = dist.get_world_size(), dist.get_rank()
        shard = padded = 0
        for p in ddp.plain.parameters():
            rows, row = torch.arange(p.shape[0]).chunk(k), p.numel() // p.shape[0]
            shard += (len(rows[rank]) if rank < len(rows) else 0) * row
            padded += -(-p.shape[0] // k) * row
        n_tensors = len(list(fsdp.model.parameters()))
        predicted = {"params_bytes": 4 * padded, "grads_bytes": 4 * padded, "optim_bytes": 8 * shard + 4 * n_tensors}
        res["fsdp_bytes"] = gathered([fsdp.memory(optimizer), predicted])
        # The reduce-scatter input is the padded full gradient.
        res["fsdp_reduce_scatter_per_step"] = [sent.get("grad_reduce_scatter", 0) / 3, 4 * k * padded]
        res["fsdp_all_gather_per_step"] = sent.get("param_all_gather", 0) / 3
        for ac in ("full", "selective"):
            model = make(family, None, CommCounter(), ac=ac)
            train(model, family, steps=3)
            res[f"ddp_ac_{ac}"] = max_diff(ref, model.full_parameters())
        for mode in ("backward", "forward"):
            masking = MaskingConfig(name=mode, coverage=0.5)
            plain = make(family, masking, CommCounter())
            train(plain, family, steps=3)
            base = {k: v.detach().clone() for k, v in plain.full_parameters().items()}
            checkpointed = make(family, masking, CommCounter(), ac="full")
            train(checkpointed, family, steps=3)
            res[f"{mode}_ac_full"] = max_diff(base, checkpointed.full_parameters())
        if family == "llama":  # FSDP in bf16 with selective checkpointing against without (torch >= 2.13 re-casts
            # a block's inputs under a profiler range when the backward recomputes it)
            runs = []
            for ac in ("none", "selective"):
                model = make(family, None, CommCounter(), fsdp=True, autocast=torch.bfloat16, ac=ac)
                train(model, family, steps=3)
                runs.append({k: v.detach().clone() for k, v in model.full_parameters().items()})
            res["fsdp_bf16_ac_selective"] = max_diff(*runs)
        if family == "llama":  # the LM head and loss chunked against full, under FSDP
            res["fsdp_loss"] = {
                d: loss_check(
                    lambda chunk, a=a: make("llama", None, CommCounter(), fsdp=True, autocast=a, loss_chunk=chunk)
                )
                for d, a in (("fp32", None), ("bf16", torch.bfloat16))
            }
        if family in SHARDED_FAMILIES:  # the references of the SDP x FSDP check (K = 2 workers, F = 2)
            for gran, masking in SHARDED_MASKINGS.items():
                ref = make(family, masking, CommCounter())
                train(ref, family, steps=3, batches=worker_batch, optim=SHARDED_OPTIM)
                full = {k: v.detach().clone() for k, v in ref.full_parameters().items()}
                if dist.get_rank() == 0:
                    torch.save(full, f"{OUT}.{family}.{gran}.sdp.pt")
    return out


# LayerNorm families only: BatchNorm statistics depend on how a batch is split over ranks.
SHARDED_FAMILIES = ("llama", "swin")
SHARDED_MASKINGS = {
    "neuron": MaskingConfig(name="forward", granularity="neuron", coverage=0.5),
    "block": MaskingConfig(name="forward", granularity="block", coverage=0.5),
    # A new mask after step 2: units, weights and optimizer state move between holders.
    "neuron-resample": MaskingConfig(name="forward", granularity="neuron", coverage=0.5, resample_every=2),
    # Workers of capacities 1 and 0.5: a unit has one holder or two.
    "neuron-capacity": MaskingConfig(name="forward", granularity="neuron", capacity=[1, 0.5]),
}
# SGD with momentum: AdamW's normalisation would turn float rounding in near-zero gradients
# (the two jobs sum in different orders) into visible parameter differences.
SHARDED_OPTIM = OptimConfig(name="sgd", lr=1e-2, momentum=0.9, weight_decay=0.1)


def _predicted_sharded_bytes(sdp, shapes: dict[str, torch.Size], fsdp_degree: int) -> dict[str, int]:
    """Static bytes of one SDP x FSDP rank, from the mask and the sharding rule alone.

    The worker's tensors: shared ones whole, held blocks whole, neuron-sliced ones with
    the held units' positions along the sliced dim. FSDP shards a tensor sliced along
    dim 0 along its largest other dim that F divides (exactly 1/F), replicates it when
    there is none (1-D biases), and shards everything else along dim 0, stored (with
    its gradient) padded to ceil(rows / F) rows; SGD's momentum is the unpadded shard.
    """
    f, shard = fsdp_degree, sdp.shard
    local: dict[str, tuple[list[int], int | None]] = {n: (list(shapes[n]), None) for n in sdp.spec.shared_params}
    for g, group in enumerate(sdp.spec.groups):
        held = torch.as_tensor(sdp.mask.held_units(sdp.worker, g), dtype=torch.long)
        for s in group.slices:
            if s.is_buffer or s.name not in shapes or held.numel() == 0:
                continue
            shape = list(shapes[s.name])
            if s.dim is not None:
                shape[s.dim] = s.unit_positions(held).numel()
            local[s.name] = (shape, s.dim)
    params = grads = momentum = 0
    for shape, sliced in local.values():
        numel = torch.Size(shape).numel()
        even = [j for j in range(1, len(shape)) if shape[j] % f == 0] if sliced == 0 else []
        if sliced == 0 and not even:  # replicated on the worker's ranks
            params, grads, momentum = params + numel, grads + numel, momentum + numel
        elif even:
            params, grads, momentum = params + numel // f, grads + numel // f, momentum + numel // f
        else:
            rows, row = shape[0], numel // shape[0] if shape[0] else 0
            per = -(-rows // f)
            params, grads = params + per * row, grads + per * row
            momentum += max(0, min(rows, (shard + 1) * per) - shard * per) * row
    return {"params_bytes": 4 * params, "grads_bytes": 4 * grads, "optim_bytes": 4 * momentum}


def sharded() -> dict:
    """K = 2 SDP workers x F = 2 FSDP shards (4 ranks), forward masking at both granularities:
    parameters after 3 steps (saved for the test to compare with plain SDP), and each rank's
    bytes against a prediction from the mask."""
    out = {}
    rank = dist.get_rank()
    for family in TINY_MODELS:  # ResNet for the bytes (its BatchNorm weights are replicated)
        cfg = tiny_model_cfg(family)
        with torch.device("meta"):
            shapes = {n: p.shape for n, p in build_model(cfg).named_parameters()}
        out[family] = {}
        for gran, masking in SHARDED_MASKINGS.items():

            def sharded_sdp(overlap: bool, family=family, masking=masking, chunk=None, backend=None):
                return make(
                    family,
                    masking,
                    CommCounter(),
                    fsdp=True,
                    fsdp_degree=2,
                    overlap=overlap,
                    loss_chunk=chunk,
                    compile_backend=backend,
                )

            sdp = sharded_sdp(True)
            optimizer = train(sdp, family, steps=3, optim=SHARDED_OPTIM)
            full = {k: v.detach().clone() for k, v in sdp.full_parameters().items()}
            if rank == 0 and family in SHARDED_FAMILIES:
                torch.save(full, f"{OUT}.{family}.{gran}.sharded.pt")
            predicted = _predicted_sharded_bytes(sdp, shapes, 2)
            out[family][gran] = {
                "bytes": gathered([sdp.memory(optimizer), predicted]),
                "replicated": sdp.describe()["replicated_params"],
            }
            if family in SHARDED_FAMILIES:  # the serial reference, from the same start
                serial = sharded_sdp(False)
                train(serial, family, steps=3, optim=SHARDED_OPTIM)
                out[family][gran]["overlap_vs_serial"] = max(gathered(max_diff(full, serial.full_parameters())))
            if family == "llama":  # the LM head and loss chunked against full
                out[family][gran]["loss"] = loss_check(lambda chunk, build=sharded_sdp: build(True, chunk=chunk))
            if family == "llama" and gran == "neuron":  # compiled against eager
                out[family][gran]["compile"] = compile_check(
                    family,
                    None,
                    backend="aot_eager",
                    build=lambda backend, build=sharded_sdp: build(True, backend=backend),
                )
    return out


@functools.cache  # both granularities' checks compare against the same references (read only)
def full_grads(family: str, rank: int) -> dict[str, torch.Tensor]:
    """The full model's gradient on `rank`'s first batch, computed in this process alone."""
    cfg = pickle.loads(_composed(tuple(overrides(family, None)), 1)).model
    torch.manual_seed(0)
    model = build_model(cfg).train()
    loss, _ = forward_loss(model, batch(family, rank, 0), in_model=computes_loss(cfg))
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _at(t: torch.Tensor, e) -> torch.Tensor:
    return (
        t
        if e.full_dim is None
        else t.narrow(e.full_dim, e.full_start, e.piece.numel // (t.numel() // t.shape[e.full_dim]))
    )


def holders_check(family: str, gran: str) -> dict:
    """K workers, C = 0.5, backward masking: averaged gradients, norms, bytes; forward masking: bytes, assembly."""
    rank, k = dist.get_rank(), dist.get_world_size()
    refs = [full_grads(family, r) for r in range(k)]
    res: dict = {}

    # Backward masking: one synced gradient against the mean of the holders' full gradients.
    comm = CommCounter()
    sdp = make(family, MaskingConfig(name="backward", granularity=gran, coverage=0.5), comm)
    sdp.model.train()
    loss, _ = forward_loss(sdp.model, batch(family, rank, 0), in_model=sdp.loss_in_model)
    loss.backward()
    sdp.after_backward()
    worst = 0.0
    ref_sq = torch.zeros((), dtype=torch.float64)
    for e in sdp.subnet.grad_entries:
        expected = torch.stack([_at(refs[h][e.name], e) for h in e.holders]).mean(0)
        got = e.piece.view(e.piece.tensor.grad)
        # Relative to the tensor's gradient: a piece whose true gradient is zero (a Swin head's
        # key bias: softmax ignores a shift shared by all keys) holds rounding noise only.
        scale = max(refs[h][e.name].abs().max() for h in e.holders).clamp_min(1e-12)
        worst = max(worst, ((got - expected).abs().max() / scale).item())
        if e.holders[0] == rank:
            ref_sq += expected.double().pow(2).sum()
    dist.all_reduce(ref_sq)
    res["backward_grad_rel_err"] = max(gathered(worst))
    res["global_norm"] = [sdp.sync.global_norm(rank=rank).item(), ref_sq.sqrt().item()]
    trainable = {id(p) for p in sdp.trainable()}
    res["frozen_with_grad"] = sum(
        gathered(sum(1 for p in sdp.model.parameters() if id(p) not in trainable and p.grad is not None))
    )
    optimizer = build_optimizer(sdp.trainable(), OptimConfig(lr=1e-3))
    optimizer.step()
    sdp.after_step()
    # Bytes sent, against sizes from the unit spec and the mask: with r = 2 holders every held
    # unit element is all-reduced once, every shared one once, and each rank broadcasts the
    # (non-buffer) chunks it is the sender of.
    sent = comm.end_step()
    held_units = _predicted_held(sdp, family, rank) - sum(sdp.shapes[n].numel() for n in sdp.spec.shared_params)
    sends = sum(ch.numel(sdp.shapes[ch.tensor]) for ch in sdp.chunks if ch.source == rank and not ch.is_buffer)
    res["comm_bytes"] = gathered(
        [
            [sent.get("grad_sync", 0), 4 * held_units],
            [sent.get("shared_sync", 0), 4 * sum(sdp.shapes[n].numel() for n in sdp.spec.shared_params)],
            [sent.get("weight_refresh", 0), 4 * sends],
        ]
    )
    res["optimizer_state_outside_trainable"] = sum(gathered(sum(1 for p in optimizer.state if id(p) not in trainable)))
    mem = sdp.memory(optimizer)
    held = _predicted_held(sdp, family, rank)
    predicted = {
        "params_bytes": 4 * sdp.full_params,
        "grads_bytes": 4 * held,
        "optim_bytes": 8 * held + 4 * len(sdp.trainable()),
    }
    res["backward_bytes"] = gathered([mem, predicted])

    # Forward masking: bytes of the physical submodel, then assembly after two steps.
    sdp, full = _forward_checks(family, MaskingConfig(name="forward", granularity=gran, coverage=0.5), res)
    local_vs_assembled = 0.0
    for e in sdp.subnet.grad_entries:  # every held piece, in plain coordinates
        local_vs_assembled = max(local_vs_assembled, (e.piece.view() - _at(full[e.name], e)).abs().max().item())
    res["local_vs_assembled"] = max(gathered(local_vs_assembled))
    digest = hashlib.sha256(sdp.mask.matrix().tobytes()).hexdigest()
    res["mask_identical_on_all_ranks"] = len(set(gathered(digest))) == 1
    res["stats"] = sdp.describe()["mask"]
    for mode in ("backward", "forward"):
        res[f"resample_{mode}"] = resample_check(family, gran, mode)
    return res


def _forward_checks(family: str, masking: MaskingConfig, res: dict) -> tuple[SDPStrategy, dict]:
    """Forward masking, two steps: each rank's bytes against its held units (`res["forward_bytes"]`)
    and the assembled model against rank 0's (`res["assembled_rank_diff"]`). Returns the strategy
    and its assembled parameters."""
    sdp = make(family, masking, CommCounter())
    optimizer = train(sdp, family, steps=2)
    held = _predicted_held(sdp, family, dist.get_rank())
    predicted = {"params_bytes": 4 * held, "grads_bytes": 4 * held, "optim_bytes": 8 * held + 4 * len(sdp.trainable())}
    res["forward_bytes"] = gathered([sdp.memory(optimizer), predicted])
    full = sdp.full_parameters()
    flat = torch.cat([full[n].reshape(-1) for n in sorted(full)])
    mine = flat.clone()
    dist.broadcast(flat, src=0)
    res["assembled_rank_diff"] = max(gathered((mine - flat).abs().max().item()))
    return sdp, full


def _state(sdp: SDPStrategy, optimizer) -> dict:
    """The optimizer state of every unit and shared tensor in plain coordinates (collective)."""
    full, scalars = gather_state(
        optimizer,
        sdp.subnet.grad_entries,
        sdp.chunks,
        shapes=sdp.shapes,
        rank=dist.get_rank(),
        comm=CommCounter(),
        bucket_cap_mb=1,
        device=CPU,
    )
    return {f"{key}/{name}": t for key, per_name in full.items() for name, t in per_name.items()}, scalars


def resample_check(family: str, gran: str, mode: str, capacity: list[float] | None = None) -> dict:
    """K workers, C = 0.5 (or `capacity`): two steps, a resample, one more step. The resample must
    not change the model or any unit's optimizer state; only where they live."""
    rank = dist.get_rank()
    comm = CommCounter()
    masking = MaskingConfig(name=mode, granularity=gran, coverage=0.5, resample_every=2, capacity=capacity)
    sdp = make(family, masking, comm)
    optimizer = train(sdp, family, steps=2)
    before = {k: v.clone() for k, v in sdp.full_parameters().items()}
    state_before, scalars_before = _state(sdp, optimizer)
    old_mask = sdp.mask.matrix()
    assert not sdp.resample(1, optimizer)  # not a multiple of resample_every
    changed = sdp.resample(2, optimizer)
    res = {"changed": changed, "mask_moved": bool((sdp.mask.matrix() != old_mask).any()), "epoch": sdp.epoch}
    res["weights_diff"] = max(gathered(max_diff(before, sdp.full_parameters())))
    state_after, scalars_after = _state(sdp, optimizer)
    res["state_diff"] = max(gathered(max_diff(state_before, state_after)))
    res["state_nonzero"] = min(gathered(min(t.abs().sum().item() for t in state_before.values())))
    res["steps_kept"] = [scalars_before["step"].item(), scalars_after["step"].item()]
    # Every holder's placed state (not only the sender's) is the unit's state.
    local = 0.0
    for e in sdp.subnet.grad_entries:
        st = optimizer.state[e.piece.tensor]
        for key in ("exp_avg", "exp_avg_sq"):
            local = max(local, (e.piece.view(st[key]) - _at(state_before[f"{key}/{e.name}"], e)).abs().max().item())
    res["holder_state_diff"] = max(gathered(local))
    res["optimizer_tracks_trainable"] = gathered(
        [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in sdp.trainable()]
        and set(optimizer.state) == set(sdp.trainable())
    )
    train(sdp, family, steps=1, optimizer=optimizer, first=2)  # the new subnetwork trains on
    held = _predicted_held(sdp, family, rank)
    params = 4 * sdp.full_params if mode == "backward" else 4 * held
    predicted = {"params_bytes": params, "grads_bytes": 4 * held, "optim_bytes": 8 * held + 4 * len(sdp.trainable())}
    res["bytes"] = gathered([sdp.memory(optimizer), predicted])
    res["resample_bytes"] = sum(gathered(comm.end_step().get("resample", 0)))
    return res


def _predicted_held(sdp: SDPStrategy, family: str, rank: int) -> int:
    """Trainable elements predicted from the unit spec and the mask alone (not from the built submodel)."""
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in build_model(tiny_model_cfg(family)).named_parameters()}
    shared = sum(shapes[n].numel() for n in sdp.spec.shared_params)
    units = sum(sdp.mask.held_units(rank, g).size * group.unit_numel(shapes) for g, group in enumerate(sdp.spec.groups))
    return shared + units


# Workers of different capacities, K = 4: (family, granularity, capacities). Capacities that sum
# to 2 give every unit 2 holders (a + b is the same sum in any order, so the averages are
# compared bit for bit); the others give 3 or 4 (compared within float rounding). The tiny
# ResNet's and Swin's last block is 3/4 of their block parameters: no capacity may be below it.
CAPACITY_CASES = [
    ("resnet", "neuron", [1, 0.5, 0.25, 0.25]),
    ("llama", "block", [1, 0.5, 0.25, 0.25]),
    ("llama", "neuron", [1, 1, 0.5, 0.5]),
    ("swin", "neuron", [1, 0.75, 0.5, 0.5]),
    ("swin", "block", [1, 1, 0.8, 0.8]),
    ("resnet", "block", [1, 0.8, 0.8, 0.8]),
]


def _averaging(family: str, gran: str, capacity: list[float]) -> dict:
    """Backward masking, one step, serial averaging: each synced unit gradient against the mean
    of its holders' own gradients (gathered before the sync; `pairs_abs_diff`: the largest
    difference over the units with two holders), and against the mean of their single-process
    full-model gradients (within rounding: backward masking's products are the held runs'); the
    clipping norm."""
    rank, k = dist.get_rank(), dist.get_world_size()
    refs = [full_grads(family, r) for r in range(k)]
    sdp = make(
        family, MaskingConfig(name="backward", granularity=gran, capacity=capacity), CommCounter(), overlap=False
    )
    sdp.model.train()
    loss, _ = forward_loss(sdp.model, batch(family, rank, 0), in_model=sdp.loss_in_model)
    loss.backward()
    local = {n: torch.zeros_like(refs[0][n]) for n in refs[0]}
    for e in sdp.subnet.grad_entries:
        _at(local[e.name], e).copy_(e.piece.view(e.piece.tensor.grad))
    own = gathered(local)
    sdp.after_backward()
    pairs, own_rel, ref_rel, ref_sq, counts = 0.0, 0.0, 0.0, torch.zeros((), dtype=torch.float64), set()
    for e in sdp.subnet.grad_entries:
        got = e.piece.view(e.piece.tensor.grad)
        for grads, worst in ((own, "own"), (refs, "ref")):
            parts = [_at(grads[h][e.name], e) for h in e.holders]
            expected = sum(parts[1:], parts[0]) / len(parts)  # summed in holder order, then divided
            # Relative to the tensor's gradient, as in holders_check (a key bias's is noise).
            scale = max(grads[h][e.name].abs().max() for h in e.holders).clamp_min(1e-12)
            rel = ((got - expected).abs().max() / scale).item()
            if len(e.holders) == 2 and worst == "own":  # a + b: the same bits in either order
                pairs = max(pairs, (got - expected).abs().max().item())
            if worst == "own":
                own_rel = max(own_rel, rel)
            else:
                ref_rel = max(ref_rel, rel)
                if e.holders[0] == rank:
                    ref_sq += expected.double().pow(2).sum()
        counts.add(len(e.holders))
    dist.all_reduce(ref_sq)
    return {
        "pairs_abs_diff": max(gathered(pairs)),
        "own_rel_err": max(gathered(own_rel)),
        "ref_rel_err": max(gathered(ref_rel)),
        "unit_holder_counts": sorted(set().union(*gathered(counts))),
        "global_norm": [sdp.sync.global_norm(rank=rank).item(), ref_sq.sqrt().item()],
        "sdp": sdp,
    }


def capacity_check(family: str, gran: str, capacity: list[float]) -> dict:
    """Backward masking: the averaging (`_averaging`) and each rank's bytes against its held
    units; forward masking: bytes and assembly after two steps; both: the order of collectives
    of two overlapped steps."""
    rank = dist.get_rank()
    res = _averaging(family, gran, capacity)
    sdp = res.pop("sdp")
    optimizer = build_optimizer(sdp.trainable(), OptimConfig(lr=1e-3))
    optimizer.step()
    held = _predicted_held(sdp, family, rank)
    predicted = {
        "params_bytes": 4 * sdp.full_params,
        "grads_bytes": 4 * held,
        "optim_bytes": 8 * held + 4 * len(sdp.trainable()),
    }
    res["backward_bytes"] = gathered([sdp.memory(optimizer), predicted])
    sdp, _ = _forward_checks(family, MaskingConfig(name="forward", granularity=gran, capacity=capacity), res)
    res["stats"] = sdp.describe()["mask"]
    for mode in ("backward", "forward"):
        trace: list = []
        masking = MaskingConfig(name=mode, granularity=gran, capacity=capacity)
        trainer_steps(make(family, masking, CommCounter()), family, steps=2, trace=trace)
        res[f"trace_{mode}"] = gathered([[list(g) if isinstance(g, tuple) else g, k, i] for g, k, i in trace])
    return res


def equal_capacity_check(family: str) -> dict:
    """masking.capacity=[0.5] * 4 against masking.coverage=0.5: parameters after 3 steps, both modes."""
    out = {}
    for mode in ("backward", "forward"):
        params = []
        for masking in (
            MaskingConfig(name=mode, coverage=0.5),
            MaskingConfig(name=mode, capacity=[0.5] * 4),
        ):
            sdp = make(family, masking, CommCounter())
            train(sdp, family, steps=3)
            params.append({k: v.detach().clone() for k, v in sdp.full_parameters().items()})
        out[mode] = max(gathered(max_diff(*params)))
    return out


def capacity() -> dict:
    out = {f"{f}-{g}-{'-'.join(map(str, c))}": capacity_check(f, g, c) for f, g, c in CAPACITY_CASES}
    out["equal"] = {family: equal_capacity_check(family) for family in ("llama", "resnet")}
    out["resample"] = {
        mode: resample_check("llama", "neuron", mode, capacity=[1, 1, 0.5, 0.5]) for mode in ("backward", "forward")
    }
    return out


def holders() -> dict:
    out = {f"{family}-{gran}": holders_check(family, gran) for family in TINY_MODELS for gran in ("neuron", "block")}
    out["overlap"] = overlap_checks()
    out["loss"] = loss_checks()
    return out


def loss_check(build) -> dict:
    """One step of the tiny LLaMA with the LM head and loss computed 24 tokens at a time (of 64
    a rank) against the full-size loss: the loss and every gradient this rank trains, after the
    strategy's gradient sync, as each tensor's largest difference relative to its largest entry
    (the LM head's weight apart). `build(loss_chunk)` makes the strategy (see `make`)."""
    runs = []
    for chunk in (None, 24):
        strategy = build(chunk)
        strategy.model.train()
        with strategy.autocast():
            loss, _ = forward_loss(strategy.model, batch("llama", dist.get_rank(), 0), in_model=strategy.loss_in_model)
        loss.backward()
        strategy.after_backward()
        model = strategy.model.module if isinstance(strategy.model, DistributedDataParallel) else strategy.model
        head = model.get_parameter("lm_head.weight")
        runs.append((loss.detach(), [(p is head, local(p.grad).clone()) for p in strategy.trainable()]))
    (loss_full, grads_full), (loss_chunked, grads_chunked) = runs
    rel = [
        (is_head, ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
        for (is_head, a), (_, b) in zip(grads_chunked, grads_full, strict=True)
    ]
    return {
        "loss_rel": max(gathered(((loss_chunked - loss_full).abs() / loss_full.abs()).item())),
        "grad_rel": max(gathered(max(r for is_head, r in rel if not is_head))),
        "head_grad_rel": max(gathered(max(r for is_head, r in rel if is_head))),
        "tensors": min(gathered(len(rel))),
    }


# DDP and every SDP masking mode x granularity at C = 0.5 (the loss and compile checks).
MASKING_CASES = {
    "ddp": None,
    **{
        f"{m}-{g}": MaskingConfig(name=m, granularity=g, coverage=0.5)
        for m in ("backward", "forward")
        for g in ("neuron", "block")
    },
}


def loss_checks() -> dict:
    return {
        f"{name}-{dtype}": loss_check(
            lambda chunk, masking=masking, autocast=autocast: make(
                "llama", masking, CommCounter(), autocast=autocast, loss_chunk=chunk
            )
        )
        for name, masking in MASKING_CASES.items()
        for dtype, autocast in (("fp32", None), ("bf16", torch.bfloat16))
        if dtype == "fp32" or name in ("ddp", "backward-neuron", "forward-block")  # bf16: one of each path
    }


def trainer_steps(
    strategy, family: str, *, steps: int, accum: int = 1, trace: list | None = None, losses: list | None = None
) -> torch.optim.Optimizer:
    """`steps` steps of the trainer's own train_step (clipping at 1.0, the NaN/Inf guard, `accum`
    micro-batches of 2 samples), then a resample where the mask asks for one, as the loop does.
    With `trace`, the collectives of the first two steps are recorded into it; with `losses`, each
    step's loss is appended to it."""
    rank = dist.get_rank()
    optimizer = build_optimizer(strategy.trainable(), OptimConfig(lr=1e-3, weight_decay=0.1))
    cfg = TrainerConfig(grad_accum_steps=accum, grad_clip=1.0, on_nonfinite="stop")
    micro = 4 // accum
    strategy.model.train()
    for step in range(1, steps + 1):
        strategy.trace_collectives(trace if step <= 2 else None)
        whole = batch(family, rank, step)
        parts = iter([{k: v[i * micro : (i + 1) * micro] for k, v in whole.items()} for i in range(accum)])
        loss = train_step(strategy, optimizer, parts, cfg=cfg, micro=micro, device=CPU, timer=PhaseTimer(CPU))
        if losses is not None:
            losses.append(loss.item())
        if step < steps and strategy.resample(step, optimizer):
            strategy.model.train()
    strategy.trace_collectives(None)
    return optimizer


def digest(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each tensor's values as the first 16 hex digits of a SHA-256 of its bytes, by name (in the
    logical order of its elements, whatever its layout)."""
    return {
        k: hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]
        for k, t in sorted(tensors.items())
    }


# Overlapped against serial averaging: (family, mode, granularity, extra settings) of each check.
OVERLAP_CASES = [
    *[(f, m, g, {}) for f in TINY_MODELS for m in ("backward", "forward") for g in ("neuron", "block")],
    ("llama", "backward", "neuron", {"ac": "full"}),
    ("llama", "forward", "neuron", {"ac": "selective"}),
    ("llama", "backward", "neuron", {"autocast": torch.bfloat16}),
    ("llama", "forward", "block", {"autocast": torch.bfloat16}),
    ("swin", "backward", "neuron", {"accum": 2}),
    ("resnet", "forward", "neuron", {"accum": 2}),
    ("llama", "backward", "neuron", {"resample_every": 2}),
    ("llama", "forward", "neuron", {"resample_every": 2}),
]


def _case_name(family: str, mode: str, gran: str, extra: dict) -> str:
    return "-".join([family, mode, gran, *(f"{k}={v}" for k, v in extra.items())]).replace("torch.", "")


def overlap_check(family: str, mode: str, gran: str, extra: dict) -> dict:
    """K = 4, C = 0.5: three steps overlapped and three serial from the same start; the
    parameters and every unit's optimizer state afterwards, and the overlapped run's order
    of collectives over its first two steps. `bits`: the overlapped run's losses (each rank's,
    as float.hex) and digests of its parameters and state, for comparison with an earlier
    version of the code (tests/data/bits_k4.json)."""
    extra = dict(extra)
    accum, every = extra.pop("accum", 1), extra.pop("resample_every", 0)
    masking = MaskingConfig(name=mode, granularity=gran, coverage=0.5, resample_every=every)
    runs, trace, losses = {}, [], []
    for overlap in (True, False):
        sdp = make(family, masking, CommCounter(), overlap=overlap, **extra)
        optimizer = trainer_steps(
            sdp, family, steps=3, accum=accum, trace=trace if overlap else None, losses=losses if overlap else None
        )
        state, _ = _state(sdp, optimizer)
        runs[overlap] = ({k: v.detach().clone() for k, v in sdp.full_parameters().items()}, state)
    (p_on, s_on), (p_off, s_off) = runs[True], runs[False]
    return {
        "params_diff": max(gathered(max_diff(p_on, p_off))),
        "state_diff": max(gathered(max_diff(s_on, s_off))),
        "state_nonzero": min(gathered(min(t.abs().sum().item() for t in s_off.values()))),
        "trace": gathered([[list(g) if isinstance(g, tuple) else g, k, i] for g, k, i in trace]),
        "bits": {
            "losses": gathered([x.hex() for x in losses]),
            "params": digest(p_on),
            "state": hashlib.sha256(json.dumps(digest(s_on)).encode()).hexdigest()[:16],
        },
    }


def wrong_order_trace() -> list:
    """The collectives of two overlapped steps with rank 1 launching in a deliberately wrong
    order (the world's buckets before every other): gloo runs it, NCCL could deadlock."""
    from sdp.subnet import sync

    key = sync.Bucket.order_key
    if dist.get_rank() == 1:
        sync.Bucket.order_key = property(lambda b: (-len(b.holders), -b.ready_at, b.holders, b.kind, b.index))
    try:
        sdp = make("llama", MaskingConfig(name="forward", coverage=0.5), CommCounter())
    finally:
        sync.Bucket.order_key = key
    trace = []
    trainer_steps(sdp, "llama", steps=2, trace=trace)
    return gathered([[list(g) if isinstance(g, tuple) else g, k, i] for g, k, i in trace])


def overlap_checks() -> dict:
    out = {_case_name(*case): overlap_check(*case) for case in OVERLAP_CASES}
    out["wrong_order"] = wrong_order_trace()
    return out


def compile_check(family: str, masking: MaskingConfig | None, *, backend: str, build=None, **extra) -> dict:
    """One step compiled (every block's forward, `backend`) against eager from the same start:
    the loss and every gradient this rank trains after the gradient sync (relative to each
    tensor's largest entry), then a second step's loss (the first update and, under backward
    masking, the weight refresh into the compiled blocks). `build(backend)`: the strategy, when
    not `make`'s (SDP x FSDP)."""
    runs = []
    for compiled in (None, backend):
        if build is not None:
            strategy = build(compiled)
        else:
            strategy = make(family, masking, CommCounter(), compile_backend=compiled, **extra)
        optimizer = build_optimizer(strategy.trainable(), OptimConfig(name="sgd", lr=1e-2, momentum=0.9))
        strategy.model.train()
        losses, grads = [], None
        for step in range(2):
            optimizer.zero_grad(set_to_none=True)
            with strategy.autocast():
                loss, _ = forward_loss(
                    strategy.model, batch(family, dist.get_rank(), step), in_model=strategy.loss_in_model
                )
            loss.backward()
            strategy.after_backward()
            grads = grads or [local(p.grad).clone() for p in strategy.trainable()]
            optimizer.step()
            strategy.after_step()
            losses.append(loss.detach())
        runs.append((losses, grads))
    (eager_losses, eager), (compiled_losses, compiled) = runs
    return {
        "loss_rel": max(
            gathered(max(((c - e).abs() / e.abs()).item() for c, e in zip(compiled_losses, eager_losses, strict=True)))
        ),
        "grad_rel": max(
            gathered(
                max(
                    ((c - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()
                    for c, e in zip(compiled, eager, strict=True)
                )
            )
        ),
        "tensors": min(gathered(len(eager))),
    }


def compile_checks() -> dict:
    """Every masking mode x granularity of the tiny LLaMA and ResNet, compiled with dynamo and
    AOTAutograd (`aot_eager`: the graphs inductor would be given, run by torch's own kernels,
    so the same bits are expected; tests/test_compile.py runs inductor's code)."""
    out = {
        f"{family}-{name}": compile_check(family, masking, backend="aot_eager")
        for family in ("llama", "resnet")
        for name, masking in MASKING_CASES.items()
    }
    out["llama-fsdp"] = compile_check("llama", None, backend="aot_eager", fsdp=True)
    out["llama-fsdp-bf16"] = compile_check("llama", None, backend="aot_eager", fsdp=True, autocast=torch.bfloat16)
    for name in ("ddp", "forward-neuron", "backward-neuron"):
        out[f"llama-{name}-bf16"] = compile_check(
            "llama", MASKING_CASES[name], backend="aot_eager", autocast=torch.bfloat16
        )
    return out


def main(argv: list[str]) -> int:
    """`SCENARIO PATH`: run the scenario on this rank of the job (torchrun's environment); rank 0
    writes its result to PATH."""
    global OUT
    scenario, path = argv
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    OUT = path
    scenarios = {"equivalence": equivalence, "holders": holders, "stacking": stacking, "sharded": sharded}
    scenarios["capacity"] = capacity
    result = {**scenarios, "compile": compile_checks, "overlap": overlap_checks}[scenario]()
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # python -m torch.distributed.run --nproc_per_node=K tests/dist_harness.py SCENARIO OUT
    code = main(sys.argv[1:3])
    # As the entrypoint does: leave without the interpreter's teardown, where a gloo thread of a
    # collected process group occasionally aborts the process after everything was written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
