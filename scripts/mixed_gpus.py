"""Workers of different capacities against uniform coverage and DDP, 4 CPU processes on real data.

Capacities [1, 1, 0.5, 0.5] are two large cards and two small ones: the small workers hold
half of every unit group, the large ones all of it, so every unit has 3 holders. Uniform
C = 0.75 has the same total (3 holders per unit) spread evenly; DDP holds everything
everywhere. For each run this prints and writes, per rank, the bytes of parameters,
gradients and optimizer state measured, the parameter and gradient bytes the mask predicts
from that rank's held units (checked equal), the live peak and the bytes sent per step, and
the run's quality.

    python scripts/mixed_gpus.py [--text] [--out DIR] [override ...]

Vision: resnet_tiny on Fashion-MNIST (experiment=demo_fmnist), both masking modes; text:
llama_tiny on the standard library's sources (experiment=demo_text), forward masking. The
tables go to DIR/<suite>.md (default results/mixed_gpus/); the run dirs stay under
outputs/mixed_gpus/.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from sdp.launching.variants import Result, run_variants
from sdp.models import build_on_meta
from sdp.run.config import load_config
from sdp.subnet.plan import SubnetPlan

NPROC = 4
CAPACITY = "[1,1,0.5,0.5]"
SUITES = {
    "vision": ("Fashion-MNIST / resnet_tiny", ["experiment=demo_fmnist"], ("backward", "forward")),
    "text": ("stdlib text / llama_tiny", ["experiment=demo_text"], ("forward",)),
}
MIB = 2**20


def variants(modes: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    out = [("DDP", ["masking=none"])]
    for mode in modes:
        out.append((f"N-SDP {mode} C=0.75", [f"masking={mode}", "masking.coverage=0.75"]))
        out.append((f"N-SDP {mode} capacity {CAPACITY}", [f"masking={mode}", f"masking.capacity={CAPACITY}"]))
    return out


def predicted(overrides: list[str]) -> list[dict[str, int]]:
    """Each rank's parameter and gradient bytes from the mask alone: the shared tensors and the
    rank's held units (fp32), the whole model's parameters under backward masking and DDP."""
    cfg = load_config(overrides, world_size=NPROC, offline=True, check_data=False)
    model = build_on_meta(cfg.model)
    total = 4 * sum(p.numel() for p in model.parameters())
    if cfg.masking.name == "none":
        return [{"params_bytes": total, "grads_bytes": total}] * NPROC
    plan = SubnetPlan.build(model, cfg.masking, family=cfg.model.family, workers=NPROC)
    out = []
    for rank in range(NPROC):
        units = sum(
            plan.mask.held_units(rank, g).size * group.unit_numel(plan.shapes)
            for g, group in enumerate(plan.spec.groups)
        )
        held = 4 * (plan.shared_params + units)
        out.append({"params_bytes": held if cfg.masking.name == "forward" else total, "grads_bytes": held})
    return out


def table(results: list[Result], predictions: list[list[dict[str, int]]]) -> tuple[str, bool]:
    """The per-rank table (markdown) and whether every measured byte count equals the prediction."""
    lines = [
        "| run | eval | rank | params+grads+optim MiB | params MiB (mask) | grads MiB (mask) | live peak MiB "
        "| sent MiB/step | step s |",
        "|" + "---|" * 9,
    ]
    exact = True
    for r, pred in zip(results, predictions, strict=True):
        s = r.summary
        if s is None:
            lines.append(f"| {r.label} | failed |" + " |" * 7)
            exact = False
            continue
        quality = f"{s.eval_acc:.2%}" if s.eval_acc is not None else f"{s.eval_loss:.3f} loss"
        for rank, (mem, want) in enumerate(zip(s.memory_per_rank, pred, strict=True)):
            ok = all(mem[k] == want[k] for k in want)
            exact &= ok
            static = mem["params_bytes"] + mem["grads_bytes"] + mem["optim_bytes"]
            mark = "" if ok else " (differs)"
            lines.append(
                f"| {r.label if rank == 0 else ''} | {quality if rank == 0 else ''} | {rank} | {static / MIB:.2f} | "
                f"{mem['params_bytes'] / MIB:.2f} ({want['params_bytes'] / MIB:.2f}){mark} | "
                f"{mem['grads_bytes'] / MIB:.2f} ({want['grads_bytes'] / MIB:.2f}) | {mem['peak_bytes'] / MIB:.1f} | "
                f"{s.comm_bytes_per_step_per_rank[rank] / MIB:.2f} | {s.step_time_s:.3f} |"
            )
    return "\n".join(lines), exact


def main(argv: list[str]) -> int:
    suite = "text" if "--text" in argv else "vision"
    out_dir = Path("results/mixed_gpus")
    if "--out" in argv:
        out_dir = Path(argv[argv.index("--out") + 1])
    extra = [a for i, a in enumerate(argv) if a not in ("--text", "--out") and (i == 0 or argv[i - 1] != "--out")]
    title, base, modes = SUITES[suite]
    base = [*base, "trainer.progress=false", *extra]
    runs = variants(modes)
    predictions = [predicted([*base, *overrides]) for _, overrides in runs]
    root = Path("outputs") / "mixed_gpus" / f"{time.strftime('%Y%m%d-%H%M%S')}-{suite}"
    results = run_variants(base, runs, root=root, nproc=NPROC)
    text, exact = table(results, predictions)
    head = (
        f"{title}, {NPROC} CPU processes, the same steps and data for every run "
        f"(`python scripts/mixed_gpus.py{' --text' if suite == 'text' else ''}"
        f"{''.join(' ' + a for a in extra)}`). In parentheses: the bytes the mask predicts from each rank's "
        "held units."
    )
    report = f"{head}\n\n{text}\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{suite}.md").write_text(report)
    print(f"\n{report}\nrun dirs under {root}/; table in {out_dir / (suite + '.md')}")
    if not exact:
        print("error: a rank's bytes differ from the mask's prediction, or a run failed", file=sys.stderr)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
