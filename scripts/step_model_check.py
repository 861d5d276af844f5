"""The step-time model against the GPU's measured steps: fitted on DDP's rows, checked on the rest.

    python scripts/step_model_check.py [--measured results/bench/gpu_speed_h200.json]
                                       [--cluster h200_nvlink] [--out results/bench] [--smoke]

For every row of a `scripts/gpu_speed_check.py` run (one rank of a K-worker job under a fake
process group: compute only), this traces the same configuration with the estimator (its
ops in order, `Estimate.ops`) and models its compute on the cluster (`sdp.planning.step_time.
compute_clock`). The host's time per launch, `launch_us`, is the cluster's (a stated value: no
row of DDP's is bound by its launches, so none can fit it). Three constants are fitted, on DDP's
rows alone:

- `efficiency` (the share of peak a large matrix product reaches, 0.5 to 1) and
  `memory_efficiency` (the share of the bandwidth the other ops reach) on DDP's eager forward and
  backward phases: a grid over both, the least squared relative error of the two phases;
- `compiled_fusion` (the share of the forward's and backward's elementwise launches and bytes a
  compiled block keeps) on DDP's compiled forward and backward, with the others fixed.

Every other row is then predicted, not fitted: its modelled step and phases beside the measured
ones, as a ratio. The memory bandwidth is the datasheet's (`memory_gbps`). The traces are of the
code this runs on: to check rows measured with other code, run it on that code (the rows of
gpu_speed_h200.json were measured before issue 59's sync; docs/speed.md says how it was run).

Results go to OUT/step_model_<device>.md and .json; `--smoke` rehearses it on the tiny LLaMA with
made-up measurements (the test suite runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

from sdp.planning.estimator import estimate
from sdp.planning.ranks import busiest_rank
from sdp.planning.step_time import compute_clock, load_cluster, phase_seconds
from sdp.run.config import load_config

PHASES = ("forward", "backward", "sync", "optimizer")
BASE = ["dataset=fineweb", "dataset.seq_len=1024", "trainer.global_batch_size=64", "parallelism.mixed_precision=bf16"]
VARIANTS = {  # as scripts/gpu_speed_check.py names them
    "DDP": ["masking=none"],
    "N-SDP forward": ["masking=forward", "masking.coverage=0.5"],
    "B-SDP forward": ["masking=forward", "masking.granularity=block", "masking.coverage=0.5"],
    "N-SDP backward": ["masking=backward", "masking.coverage=0.5"],
}
SMOKE = ["dataset=synthetic_text", "dataset.seq_len=32", "trainer.global_batch_size=8"]
EFFICIENCIES = [round(0.50 + 0.01 * i, 2) for i in range(51)]  # 0.50 .. 1.00
MEMORY = [round(0.05 + 0.01 * i, 2) for i in range(96)]  # 0.05 .. 1.00
FUSIONS = [round(0.02 * i, 2) for i in range(1, 51)]  # 0.02 .. 1.00


def traced(model: str, variant: str, *, world_size: int, smoke: bool):
    """The estimate of one rank of the row's configuration (the busiest), with its ops."""
    overrides = [f"model={model}", *(SMOKE if smoke else BASE), *VARIANTS[variant], "model.loss=chunked"]
    cfg = load_config(overrides, world_size=world_size, offline=True, check_data=False)
    return estimate(cfg, world_size=world_size, rank=busiest_rank(cfg, world_size=world_size))


def modelled(est, cluster, *, compiled: bool) -> dict[str, float]:
    """The row's phases and step on `cluster` (compute only: the measured runs moved no data)."""
    compute = compute_clock(est.ops, cluster, precision=est.precision, compiled=compiled)
    phases = phase_seconds(compute, est.ops)
    return {**{p: phases.get(p, 0.0) for p in PHASES}, "step": compute.clock[-1]}


def _error(est, cluster, measured: dict, phases: tuple[str, ...], *, compiled: bool) -> float:
    got = modelled(est, cluster, compiled=compiled)
    return sum((got[p] / measured[p] - 1) ** 2 for p in phases)


def fit(ddp, eager: dict, compiled: dict, cluster):
    """`efficiency` and `memory_efficiency` on DDP's eager forward and backward, then
    `compiled_fusion` on its compiled ones (see the module doc); returns the fitted cluster."""
    phases = ("forward", "backward")

    def eager_error(g):
        return _error(
            ddp, dataclasses.replace(cluster, efficiency=g[0], memory_efficiency=g[1]), eager, phases, compiled=False
        )

    e, memory = min(itertools.product(EFFICIENCIES, MEMORY), key=eager_error)
    cluster = dataclasses.replace(cluster, efficiency=e, memory_efficiency=memory)
    fusion = min(
        FUSIONS,
        key=lambda f: _error(ddp, dataclasses.replace(cluster, compiled_fusion=f), compiled, phases, compiled=True),
    )
    return dataclasses.replace(cluster, compiled_fusion=fusion)


def rows_of(measured: dict) -> list[dict]:
    """The measured rows (those that ran), as {model, variant, compile, loss, phases, step}."""
    out = []
    for r in measured["rows"]:
        if "measured" not in r or r["loss"] != "chunked":
            continue
        m = r["measured"]
        out.append({**{k: r[k] for k in ("model", "variant", "compile")}, "phases": m["phases_s"], "step": m["step_s"]})
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| model | variant | compile | step ms measured | modelled | modelled / measured "
        "| fwd / bwd / sync / optim ms measured | modelled | launches | fitted on |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        m, p = r["phases"], r["modelled"]
        measured_ms = " / ".join(f"{1e3 * m.get(k, 0):.0f}" for k in PHASES)
        modelled_ms = " / ".join(f"{1e3 * p[k]:.0f}" for k in PHASES)
        lines.append(
            f"| {r['model']} | {r['variant']} | {'yes' if r['compile'] else 'no'} | {1e3 * r['step']:.0f} "
            f"| {1e3 * p['step']:.0f} | {p['step'] / r['step']:.2f} | {measured_ms} | {modelled_ms} "
            f"| {r['launches']:,} | {r['fitted'] or ''} |"
        )
    return "\n".join(lines) + "\n"


def run(args) -> list[dict]:
    measured = json.loads(args.measured.read_text())
    rows = rows_of(measured)
    cluster = load_cluster(args.cluster)
    traces = {}
    for r in rows:
        key = (r["model"], r["variant"])
        if key not in traces:
            traces[key] = traced(r["model"], r["variant"], world_size=args.world_size, smoke=args.smoke)
            print(f"traced {key} in {traces[key].trace_s:.1f} s", flush=True)
    ddp = {r["compile"]: r for r in rows if r["variant"] == "DDP"}
    fitted = fit(traces[ddp[False]["model"], "DDP"], ddp[False]["phases"], ddp[True]["phases"], cluster)
    for r in rows:
        est = traces[r["model"], r["variant"]]
        r["modelled"] = modelled(est, fitted, compiled=r["compile"])
        r["launches"] = sum(est.ops["launches"])
        r["fitted"] = "eager: efficiency, memory_efficiency" if r["variant"] == "DDP" and not r["compile"] else None
        if r["variant"] == "DDP" and r["compile"]:
            r["fitted"] = "compiled: compiled_fusion"
    names = ("efficiency", "memory_efficiency", "compiled_fusion", "launch_us", "memory_gbps")
    constants = {k: getattr(fitted, k) for k in names}
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"step_model_{measured['device']}"
    payload = {"measured": str(args.measured), "cluster": args.cluster, "fitted": constants, "rows": rows}
    (args.out / f"{name}.json").write_text(json.dumps(payload, indent=1))
    head = (
        f"# The step-time model against {args.measured.name}\n\n"
        f"`python scripts/step_model_check.py {' '.join(args.argv)}`, traced with {args.traced_with}; "
        f"cluster `{args.cluster}`, fitted on DDP's "
        f"rows: efficiency {fitted.efficiency:g}, memory_efficiency {fitted.memory_efficiency:g}, compiled_fusion "
        f"{fitted.compiled_fusion:g}; stated: launch_us {fitted.launch_us:g}, memory {fitted.memory_gbps:g} GB/s "
        "(the datasheet's).\n\n"
    )
    (args.out / f"{name}.md").write_text(head + table(rows))
    print(head + table(rows))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--measured", type=Path, default=Path("results/bench/gpu_speed_h200.json"))
    parser.add_argument("--cluster", default="h200_nvlink")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("results/bench"))
    parser.add_argument("--smoke", action="store_true", help="the tiny LLaMA; --measured a rehearsal's file")
    parser.add_argument("--traced-with", default="this checkout's code", help="the code the traces ran, for the record")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    return 0 if run(args) else 1


if __name__ == "__main__":
    sys.exit(main())
