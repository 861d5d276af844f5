"""Multi-process checks of the outer loop (outer=diloco, sdp.outer): tests/test_outer.py runs
`main([SCENARIO, OUT.json])` on forked ranks (tests/ranks.py). Every rank measures; rank 0 writes
what the test asserts on.

What runs is the product's: the strategy from `sdp.run.build.build_strategy` of a composed and
checked command line, the trainer's `train_step`, and `sdp.outer.loop.OuterLoop` over
`sdp.outer.view.view_of` as the runner builds them; after each optimizer step the loop's
`after_step`, as the trainer calls it.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from dist_harness import CPU, _at, batch, gathered, overrides, run_config

from sdp.dist import World
from sdp.metrics.comm import CommCounter
from sdp.optim import OptimConfig, build_optimizer
from sdp.outer.algorithms import algorithm_of
from sdp.outer.loop import OuterLoop
from sdp.outer.view import view_of
from sdp.run.build import build_strategy
from sdp.run.measure import PhaseTimer
from sdp.run.trainer import train_step
from sdp.run.trainer_config import TrainerConfig
from sdp.subnet import MaskingConfig

ADAMW = OptimConfig(lr=1e-3, weight_decay=0.1)
SGD = OptimConfig(name="sgd", lr=0.05, momentum=0.0, nesterov=False, weight_decay=1e-3)


def build(family: str, masking: MaskingConfig | None, outer: dict | None, *, steps: int):
    """The strategy of a run of the family's tiny model under `masking` (None: DDP), and its outer
    loop (`outer`: outer.* keys; None: no outer loop), as the runner builds them."""
    line = overrides(family, masking)
    if outer is not None:
        algorithm = outer.get("name", "diloco")
        line += [f"outer={algorithm}", *[f"outer.{k}={v}" for k, v in outer.items() if k != "name"]]
    cfg = run_config([*line, f"trainer.max_steps={steps}"])
    world = World(rank=dist.get_rank(), local_rank=dist.get_rank(), world_size=dist.get_world_size())
    comm = CommCounter()
    strategy = build_strategy(cfg, world=world, device=CPU, comm=comm)
    loop = None
    if outer is not None:
        par = cfg.parallelism
        view = view_of(strategy, family=cfg.model.family, comm=comm, bucket_cap_mb=par.bucket_cap_mb)
        cap = par.bucket_cap_mb
        make = algorithm_of(cfg.outer.name).build
        loop = make(cfg.outer, view, device=CPU, comm=comm, max_steps=steps, bucket_cap_mb=cap)
    return strategy, loop, comm


def run(strategy, loop, family: str, *, steps: int, optim: OptimConfig = ADAMW, before_sync=None):
    """`steps` steps of train_step (no clipping, no NaN/Inf check), each followed by the outer
    loop's `after_step`; `before_sync(step)` is called before it."""
    optimizer = build_optimizer(strategy.trainable(), optim)
    cfg = TrainerConfig(grad_clip=0.0, on_nonfinite="off")
    rank = dist.get_rank()
    strategy.model.train()
    for step in range(1, steps + 1):
        whole = batch(family, rank, step)
        micro = whole["targets"].shape[0]
        train_step(strategy, optimizer, iter([whole]), cfg=cfg, micro=micro, device=CPU, timer=PhaseTimer(CPU))
        if loop is not None:
            if before_sync is not None:
                before_sync(step)
            loop.after_step(step)
    return optimizer


def params(strategy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in strategy.full_parameters().items()}


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def max_rel_diff(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)).item() for k in a)


def plain_run(family: str, masking: MaskingConfig | None, outer: dict | None, *, steps: int, optim=ADAMW) -> dict:
    strategy, loop, _ = build(family, masking, outer, steps=steps)
    if loop is not None:
        loop.start()
    run(strategy, loop, family, steps=steps, optim=optim)
    return params(strategy)


K1_CASES = {
    "ddp": None,
    "backward-neuron": MaskingConfig(name="backward", granularity="neuron", coverage=1.0),
    "forward-block": MaskingConfig(name="forward", granularity="block", coverage=1.0),
}


def anchors_k1() -> dict:
    """K = 1, outer lr 1 and no momentum, H = 3 over 7 steps (the last sync at the end): the
    largest difference from the plain run, per family and masking (0: bit for bit)."""
    identity = {"sync_every": 3, "lr": 1.0, "momentum": 0.0}
    out = {}
    for family in ("llama", "resnet", "swin"):
        for name, masking in K1_CASES.items():
            plain = plain_run(family, masking, None, steps=7)
            outer = plain_run(family, masking, identity, steps=7)
            out[f"{family}-{name}"] = max_diff(outer, plain)
    return out


SGD_CASES = {
    "ddp": None,
    "backward-neuron": MaskingConfig(name="backward", granularity="neuron", coverage=0.5),
    "forward-neuron": MaskingConfig(name="forward", granularity="neuron", coverage=0.5),
    "backward-block": MaskingConfig(name="backward", granularity="block", coverage=0.5),
    "forward-block": MaskingConfig(name="forward", granularity="block", coverage=0.5),
}


def anchors_sgd() -> dict:
    """K = 4, inner SGD without momentum, H = 1, outer lr 1 and no momentum: the largest
    difference from the plain DDP or SDP run relative to each tensor's largest entry (the LLaMA
    under every masking mode and granularity over 3 steps, the ResNet under DDP and forward neuron
    SDP over 1, the Swin under backward neuron and forward block SDP over 3).

    The ResNet's trajectory amplifies rounding: its ReLUs and max-pool route a gradient one way or
    the other on a near-tie, so a one-ulp change of the weights (the outer step's rounding, or a
    1e-7 perturbation of the plain run's start) moves its weights by 0.5% of a tensor's largest
    entry at step 2 and 8% at step 3 on some CPUs (an AMX Xeon). Its one step still compares every
    tensor it syncs (BatchNorm's included); the LLaMA's and Swin's three compare the loop's state
    across syncs."""
    identity = {"sync_every": 1, "lr": 1.0, "momentum": 0.0}
    out = {}
    cases = [("llama", name, 3) for name in SGD_CASES] + [("resnet", "ddp", 1), ("resnet", "forward-neuron", 1)]
    cases += [("swin", "backward-neuron", 3), ("swin", "forward-block", 3)]
    for family, name, steps in cases:
        plain = plain_run(family, SGD_CASES[name], None, steps=steps, optim=SGD)
        outer = plain_run(family, SGD_CASES[name], identity, steps=steps, optim=SGD)
        out[f"{family}-{name}"] = max(gathered(max_rel_diff(outer, plain)))
    # The pseudo-gradients on the wire in bf16: the same run within bf16's rounding of them.
    plain = plain_run("llama", None, None, steps=3, optim=SGD)
    wire = plain_run("llama", None, {**identity, "comm_dtype": "bf16"}, steps=3, optim=SGD)
    out["llama-ddp-bf16-wire"] = max(gathered(max_rel_diff(wire, plain)))
    return out


def scattered(loop: OuterLoop, shapes: dict[str, torch.Size], values=None) -> dict[str, torch.Tensor]:
    """This rank's trained pieces (or `values(tensor)` of them) in plain coordinates, NaN elsewhere."""
    out = {n: torch.full(s, float("nan"), dtype=torch.float64) for n, s in shapes.items()}
    for e in loop.view.entries:
        source = e.piece.tensor if values is None else values(e.piece.tensor)
        _at(out[e.name], e).copy_(e.piece.view(source.detach()))
    return {n: t for n, t in out.items() if not t.isnan().all()}


def _holder_average(family: str, masking: MaskingConfig | None, *, lr: float, momentum: float) -> dict:
    """Two steps of H = 2 (one sync, at the end): every rank's new values against a float64
    reference made from every rank's values just before the sync: each element's pseudo-gradient
    averaged over the ranks that hold it, then DiLoCo's first outer step,
    theta_prev - lr * (1 + momentum) * mean(Delta). The error is relative to each tensor's largest
    outer step."""
    synced = _one_sync(family, masking, {"lr": lr, "momentum": momentum})
    prev, worst, counts = synced["prev"], 0.0, set()
    for name, got in synced["new"].items():
        deltas = [prev[name] - r[name] for r in synced["local"] if name in r]
        stacked = torch.stack(deltas)
        held = ~stacked.isnan()
        mean = torch.where(held, stacked, 0.0).sum(0) / held.sum(0).clamp_min(1)
        step = lr * (1 + momentum) * mean
        want = prev[name] - step
        mine = ~got.isnan()
        counts |= set(held.sum(0)[mine].unique().tolist())
        scale = step[mine].abs().max().clamp_min(1e-30)
        worst = max(worst, ((got - want)[mine].abs().max() / scale).item())
    return {"rel_err": max(gathered(worst)), "holder_counts": sorted(set().union(*gathered(counts)))}


def holder_average() -> dict:
    out = {"llama-ddp": _holder_average("llama", None, lr=0.7, momentum=0.9)}
    uneven = (("llama", "neuron", [1, 1, 0.5, 0.5]), ("resnet", "neuron", [0.5, 0.25, 0.25, 0.25]))
    for family, gran, capacity in uneven:
        for mode in ("backward", "forward"):
            masking = MaskingConfig(name=mode, granularity=gran, capacity=capacity)
            out[f"{family}-{mode}-{gran}"] = _holder_average(family, masking, lr=0.7, momentum=0.9)
    out["llama-forward-block-lr1"] = _holder_average(
        "llama", MaskingConfig(name="forward", granularity="block", capacity=[1, 0.5, 0.25, 0.25]), lr=1.0, momentum=0
    )
    return out


def _trace(family: str, masking: MaskingConfig) -> list:
    """Every collective of the outer loop over 6 steps of H = 4, P = 2 (fragment syncs after steps
    2, 4 and 6, the last syncing both), every rank's."""
    strategy, loop, _ = build(family, masking, {"sync_every": 4, "fragments": 2}, steps=6)
    loop.trace = []
    loop.start()
    run(strategy, loop, family, steps=6)
    return gathered([[list(g) if isinstance(g, tuple) else g, k, list(i)] for g, k, i in loop.trace])


def order() -> dict:
    mixed = [1, 0.5, 0.25, 0.25]
    return {
        "llama-backward-neuron": _trace("llama", MaskingConfig(name="backward", capacity=[1, 1, 0.5, 0.5])),
        "resnet-forward-neuron": _trace("resnet", MaskingConfig(name="forward", capacity=mixed)),
        "llama-forward-block": _trace("llama", MaskingConfig(name="forward", granularity="block", capacity=mixed)),
    }


def _start(family: str, masking: MaskingConfig | None) -> dict:
    """Every rank's weights perturbed by its own amount before `start`: afterwards, the largest
    spread among the holders of any element (0: they start alike), and under backward masking
    among every rank's full weights. Then 3 steps of H = 4: inside `synced()` the model is the start
    again, outside this rank's own."""
    strategy, loop, _ = build(family, masking, {"sync_every": 4}, steps=8)
    with torch.no_grad():
        for p in strategy.model.parameters():
            p.add_(1e-3 * dist.get_rank())
    loop.start()
    shapes = {n: t.shape for n, t in strategy.full_parameters().items()}
    every = gathered(scattered(loop, shapes))
    spread = 0.0
    for name in shapes:
        stacked = torch.stack([r[name] for r in every if name in r])
        lo, hi = stacked.nan_to_num(float("inf")).min(0).values, stacked.nan_to_num(float("-inf")).max(0).values
        ok = ~stacked.isnan().all(0)
        spread = max(spread, (hi - lo)[ok].max().item())
    out = {"holder_spread": spread}
    if masking is not None and masking.name == "backward":
        full = gathered(params(strategy))
        out["full_spread"] = max(max_diff(full[0], f) for f in full)
    start = params(strategy)
    run(strategy, loop, family, steps=3)
    with loop.synced():
        inside = params(strategy)
    outside = params(strategy)
    out["synced_is_start"] = max(gathered(max_diff(inside, start)))
    out["outside_moved"] = min(gathered(max_diff(outside, start)))
    return out


def start() -> dict:
    return {
        "llama-ddp": _start("llama", None),
        "llama-backward-neuron": _start("llama", MaskingConfig(name="backward", capacity=[1, 1, 0.5, 0.5])),
        "resnet-forward-neuron": _start("resnet", MaskingConfig(name="forward", capacity=[1, 0.5, 0.25, 0.25])),
    }


ANCHOR = {"name": "sparseloco", "density": 1.0, "value_bits": 32, "error_decay": 0.0, "lr": 1.0}
SPARSE_CASES = {  # pieces of 4 holders; of 1, 2 and 4
    "llama-ddp": ("llama", None),
    "resnet-forward-neuron": ("resnet", MaskingConfig(name="forward", capacity=[1, 0.25, 0.25, 0.25])),
}
BACKWARD = MaskingConfig(name="backward", granularity="neuron", coverage=0.5)


def _one_sync(family: str, masking: MaskingConfig | None, outer: dict) -> dict:
    """Two steps of H = 2 (one sync, at the end): theta_prev and every rank's local values just
    before the sync (all in plain coordinates, every rank's), the values after it (this rank's),
    and the ops of the sync's exchange."""
    strategy, loop, comm = build(family, masking, {"sync_every": 2, **outer}, steps=2)
    loop.start()
    shapes = {n: t.shape for n, t in strategy.full_parameters().items()}
    prev = scattered(loop, shapes, values=lambda p: loop.backup[p])
    seen = {}

    def before_sync(step: int) -> None:
        seen["local"] = gathered(scattered(loop, shapes))
        comm.timeline = []

    run(strategy, loop, family, steps=2, before_sync=before_sync)
    ops = sorted({r["op"] for r in comm.timeline if r["kind"] == "outer_sync"})
    return {"prev": prev, "local": seen["local"], "new": scattered(loop, shapes), "ops": ops}


def _rank_order_reference(prev: torch.Tensor, locals_: list) -> tuple[torch.Tensor, torch.Tensor]:
    """theta_prev - the holders' pseudo-gradients summed in fp32 in rank order / holders (lr 1,
    the outer step's 0 added; an element of one holder: its own value), and each element's
    holder count."""
    p32, total, count = prev.float(), torch.zeros_like(prev, dtype=torch.float32), torch.zeros_like(prev)
    own = torch.zeros_like(p32)
    for local in locals_:
        held = ~local.isnan()
        total = torch.where(held, total + (p32 - local.float()), total)
        own = torch.where(held, local.float(), own)
        count += held
    mean = total / count.clamp_min(1).float()  # in fp32, as the holders divide
    return torch.where(count == 1, own, (p32 - mean) + (mean - mean)), count


def sparse_anchor() -> dict:
    """SparseLoCo at density 1, 32-bit values, error_decay 0, lr 1 against DiLoCo at lr 1 and no
    momentum from the same start and batches, after one sync: per element, the largest difference
    where it has <= 2 holders and the largest relative one where more; against the rank-order
    reference, the largest difference (0: bit for bit); the exchanges' ops."""
    out = {}
    for case, (family, masking) in SPARSE_CASES.items():
        dense = _one_sync(family, masking, {"lr": 1.0, "momentum": 0.0})
        sparse = _one_sync(family, masking, ANCHOR)
        few, many, reference, counts = 0.0, 0.0, 0.0, set()
        for name, got in sparse["new"].items():
            want, count = _rank_order_reference(sparse["prev"][name], [r[name] for r in sparse["local"] if name in r])
            mine = ~got.isnan()
            counts |= set(count[mine].unique().tolist())
            reference = max(reference, (got[mine] - want[mine].double()).abs().max().item())
            diff = (got - dense["new"][name]).abs()
            small = mine & (count <= 2)
            if small.any():
                few = max(few, diff[small].max().item())
            if (mine & (count > 2)).any():
                scale = (dense["prev"][name] - dense["new"][name])[mine].abs().max().clamp_min(1e-30)
                many = max(many, (diff[mine & (count > 2)].max() / scale).item())
        out[case] = {
            "few_holders": max(gathered(few)),
            "many_holders_rel": max(gathered(many)),
            "reference": max(gathered(reference)),
            "holder_counts": sorted(set().union(*gathered(counts))),
            "ops": {"diloco": dense["ops"], "sparseloco": sparse["ops"]},
        }
    return out


def feedback() -> dict:
    """LLaMA under DDP, SparseLoCo at density 0.05, 2-bit values, error_decay 0.9, chunks of 64,
    H = 2 over 4 steps (syncs after steps 2 and 4). Each bucket's compression recorded: whether
    its accumulator is error_decay * the error feedback before + the pseudo-gradient (bit for
    bit), whether what it keeps is exactly what it did not send (fp32's acc - sent), the largest
    |sent + kept - acc| over the largest |acc|; the bytes each sync sent, on the wire, and the buckets'
    sizes and holders."""
    import sdp.outer.sparseloco as sparseloco

    cfg = {"name": "sparseloco", "density": 0.05, "value_bits": 2, "error_decay": 0.9, "chunk_size": 64}
    strategy, loop, _ = build("llama", None, {"sync_every": 2, **cfg}, steps=4)
    loop.start()
    records, expected = [], []
    compress = sparseloco.compress

    def recording(layout, e):
        acc = e.clone()
        payload = compress(layout, e)
        records.append((layout, acc, payload, e.clone()))
        return payload

    def before_sync(step: int) -> None:
        if step % 2 == 0:
            for j, b in enumerate(loop.buckets[0]):
                delta = sparseloco.pack(b, lambda p: loop.backup[p] - p, dtype=torch.float32)
                want = loop.method.errors[(0, j)].clone().mul_(0.9)
                want.narrow(0, 0, b.numel).add_(delta)
                expected.append(want)

    sparseloco.compress = recording
    try:
        run(strategy, loop, "llama", steps=4, before_sync=before_sync)
    finally:
        sparseloco.compress = compress
    exact_acc, exact_kept, worst = True, True, 0.0
    for (layout, acc, payload, kept), want in zip(records, expected, strict=True):
        exact_acc &= torch.equal(acc, want)
        index, values = sparseloco.decode(layout, payload)
        dense = torch.zeros(layout.chunks, layout.chunk).scatter_(1, index, values).view(-1)[: layout.numel]
        acc, kept = acc[: layout.numel], kept[: layout.numel]
        exact_kept &= torch.equal(kept, acc - dense)
        worst = max(worst, ((dense.double() + kept.double() - acc.double()).abs().max() / acc.abs().max()).item())
    return {
        "exact_acc": all(gathered(exact_acc)),
        "exact_kept": all(gathered(exact_kept)),
        "worst": max(gathered(worst)),
        "records": len(records),
        "sent": loop.sent,
        "syncs": loop.syncs,
        "bytes_per_sync": loop.figures()["bytes_per_sync"],
        "wire_bytes_per_sync": loop.figures()["wire_bytes_per_sync"],
        "buckets": [[b.numel, len(b.holders)] for b in loop.buckets[0]],
        "error_feedback_bytes": loop.memory()["outer_error_feedback_bytes"],
    }


def ef_resize() -> dict:
    """After one sync of SparseLoCo (density 0.05, 2 bits, error_decay 0.9), the checkpointed state
    against the mean of every holder's own error feedback, and what a resume on another world size
    (`restore` without this rank's window) leaves: the largest difference from that mean, and
    between holders (0: the same)."""
    out = {}
    cfg = {"name": "sparseloco", "density": 0.05, "value_bits": 2, "error_decay": 0.9, "chunk_size": 64}
    for case, masking in (("llama-ddp", None), ("llama-backward-neuron", BACKWARD)):
        strategy, loop, _ = build("llama", masking, {"sync_every": 2, **cfg}, steps=2)
        loop.start()
        optimizer = run(strategy, loop, "llama", steps=2)
        shapes = {n: t.shape for n, t in strategy.full_parameters().items()}
        every = gathered(scattered_errors(loop, shapes))
        plain, _ = loop.checkpoint(optimizer)
        loop.restore(optimizer, plain, None)
        after = gathered(scattered_errors(loop, shapes))
        saved, restored, spread = 0.0, 0.0, 0.0
        for name in shapes:
            held = [r[name] for r in every if name in r]
            if not held:
                continue
            stacked = torch.stack(held)
            mean = stacked.nan_to_num(0).sum(0) / (~stacked.isnan()).sum(0).clamp_min(1)
            mask = ~stacked.isnan().all(0)
            saved = max(saved, (plain[f"error_feedback/{name}"].double() - mean)[mask].abs().max().item())
            now = torch.stack([r[name] for r in after if name in r])
            ok = ~now.isnan()
            restored = max(restored, (now - mean).abs()[ok].max().item())
            hi, lo = now.nan_to_num(float("-inf")).max(0).values, now.nan_to_num(float("inf")).min(0).values
            spread = max(spread, (hi - lo)[mask].max().item())
        scale = max(t.nan_to_num(0).abs().max().item() for r in every for t in r.values())
        out[case] = {"saved": saved, "restored": restored, "spread": spread, "scale": scale}
    return out


def scattered_errors(loop, shapes) -> dict[str, torch.Tensor]:
    """This rank's error feedback in plain coordinates (float64), NaN where it holds no multi-holder piece."""
    out = {}
    for j, b in enumerate(loop.buckets[0]):
        flat = loop.method.errors[(0, j)].narrow(0, 0, b.numel)
        for e, offset in zip(b.entries, b.offsets, strict=True):
            out.setdefault(e.name, torch.full(shapes[e.name], float("nan"), dtype=torch.float64))
            shape = e.piece.view(e.piece.tensor).shape
            _at(out[e.name], e).copy_(flat.narrow(0, offset, e.piece.numel).view(shape))
    return out


def main(argv: list[str]) -> int:
    """`SCENARIO PATH`: run the scenario on this rank of the job; rank 0 writes its result to PATH."""
    scenario, path = argv
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    scenarios = {"k1": anchors_k1, "sgd": anchors_sgd, "average": holder_average, "order": order, "start": start}
    scenarios |= {"sparse_anchor": sparse_anchor, "feedback": feedback, "ef_resize": ef_resize}
    names = scenario.split("+")
    result = {name: scenarios[name]() for name in names}
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # python -m torch.distributed.run --nproc_per_node=K tests/outer_harness.py SCENARIO OUT
    code = main(sys.argv[1:3])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
