"""SDP against DDP on one machine, in one invocation: per-rank bytes, communication, step time.

    python scripts/bench_sdp.py [--nproc 4] [--steps 30] [--coverage 0.5] [override ...]

For a tiny LLaMA and a tiny ResNet it launches DDP and the four SDP variants
(backward/forward masking x neuron/block) with the same data and steps, then
prints each variant's ratios to DDP next to the bound the mask predicts:

- params+grads+optimizer bytes (fp32 AdamW: 4 + 4 + 8 bytes per parameter):
  forward masking holds C of the units:   ratio = C + (1 - C) * S/N,
  backward masking keeps every weight:    ratio = (4 + 12 C)/16 + (12/16)(1 - C) * S/N,
  with S the shared parameters (embeddings, stem, head: held by every worker)
  and N all parameters, up to AdamW's 4-byte step counter per tensor (0.1% slack).
  Block units are unequal, so the largest rank of a block mask can exceed the
  bound: the imbalance is printed.
- gradient communication (unit + shared gradient all-reduce payload):
  ratio = C + (1 - C) * S/N; backward masking's weight refresh is its own line.
- step time: the targets are backward <= 1.05 x DDP and forward < DDP.
Figures are the maximum over ranks, as in summary.json.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from sdp.compare import Result, comparison_table, run_variants

MODELS = [("llama_tiny", "synthetic_text"), ("resnet_tiny", "synthetic_image")]


def variants(coverage: float) -> list[tuple[str, list[str]]]:
    out = [("DDP", ["masking=none"])]
    for gran in ("neuron", "block"):
        for mode in ("backward", "forward"):
            label = f"{gran[0].upper()}-SDP {mode}"
            out.append((label, [f"masking={mode}", f"masking.granularity={gran}", f"masking.coverage={coverage}"]))
    return out


def checks(results: list[Result], coverage: float) -> list[str]:
    ddp = results[0]
    lines = []
    for r in results[1:]:
        if r.summary is None or ddp.summary is None:
            lines.append(f"- {r.label}: failed, see {r.run_dir}")
            continue
        s = r.summary
        shared = s["shared_params"] / s["n_params"]
        forward = s["masking"] == "forward"
        mem_bound = (
            coverage + (1 - coverage) * shared if forward else (4 + 12 * coverage) / 16 + 0.75 * (1 - coverage) * shared
        )
        mem = r.static_bytes / ddp.static_bytes
        kinds = s["comm_bytes_per_step_by_kind"]
        grad = (kinds["grad_sync"] + kinds["shared_sync"]) / ddp.summary["comm_bytes_per_step"]
        grad_bound = coverage + (1 - coverage) * shared
        step = s["step_time_s"] / ddp.summary["step_time_s"]
        step_ok = step < 1.0 if forward else step <= 1.05
        target = "< 1" if forward else "<= 1.05"
        worst = max(s["mask"]["coverage_per_worker"]) / s["mask"]["coverage_target"]
        lines.append(
            f"- {r.label}: bytes {mem:.3f} x DDP (bound {mem_bound:.3f}: {'ok' if mem <= mem_bound * 1.001 else 'over'}"
            f"{f', largest rank holds {worst:.2f} x its share of units' if worst > 1.001 else ''}); "
            f"gradient comm {grad:.3f} x DDP (bound {grad_bound:.3f}: {'ok' if grad <= grad_bound + 1e-6 else 'over'})"
            + (
                f"; weight refresh {kinds['weight_refresh'] / ddp.summary['comm_bytes_per_step']:.3f} x DDP, "
                f"total comm {s['comm_bytes_per_step'] / ddp.summary['comm_bytes_per_step']:.3f} x DDP"
                if not forward
                else ""
            )
            + f"; step time {step:.2f} x DDP ({'ok' if step_ok else 'missed'}: target {target})"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--coverage", type=float, default=0.5)
    parser.add_argument("--out", type=Path, help="also write the report here (e.g. results/bench/sdp_cpu_k4.md)")
    args, overrides = parser.parse_known_args()
    root = Path("outputs") / "bench" / time.strftime("%Y%m%d-%H%M%S")
    report = []
    for model, dataset in MODELS:
        base = [
            f"model={model}",
            f"dataset={dataset}",
            f"trainer.max_steps={args.steps}",
            "trainer.eval_every=0",
            "trainer.log_every=5",
            "trainer.progress=false",
            "dataset.eval_batches=1",
            "logger=none",
            "trainer.global_batch_size=64",
            *overrides,
        ]
        results = run_variants(base, variants(args.coverage), root=root / model, nproc=args.nproc)
        report += [
            f"## {model} on {dataset}, K={args.nproc}, C={args.coverage}, {args.steps} steps",
            "",
            comparison_table(results),
            "",
            *checks(results, args.coverage),
            "",
        ]
    text = "\n".join(report)
    (root / "bench.md").write_text(text)
    if args.out:
        header = (
            "# SDP vs DDP on CPU: bytes, communication, step time\n\n"
            f"`python scripts/bench_sdp.py --nproc {args.nproc} --steps {args.steps} --coverage {args.coverage}` "
            f"on {os.cpu_count()} CPU cores with gloo, {time.strftime('%Y-%m-%d')}. Bytes and communication are "
            "exact counts (max over ranks); step times are wall-clock means on a small shared machine, so ratios "
            "within ~5% are noise. The data are synthetic: the eval and loss columns carry no meaning here.\n\n"
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(header + text)
    print("\n" + text + f"\nrun dirs under {root}/")


if __name__ == "__main__":
    main()
