"""The offline demo behind `make run`: short 2-process runs on real data, then a results table.

Each variant is one `torchrun -m sdp.train` launch; its run dir keeps config.yaml,
metrics.jsonl and summary.json. The table goes to stdout and to results.md in the
demo's folder. Extra arguments are passed to every run as overrides, e.g.
`python scripts/demo.py trainer.max_steps=50`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

NPROC = 2
VARIANTS = [
    # (label, overrides)
    ("Fashion-MNIST / resnet_tiny / DDP", ["experiment=demo_fmnist"]),
    ("stdlib text / llama_tiny / DDP", ["experiment=demo_text"]),
]


def launch(overrides: list[str], run_dir: Path) -> tuple[int, float]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={NPROC}",
        "-m",
        "sdp.train",
        *overrides,
        f"run_dir={run_dir}",
    ]
    print("$", " ".join(cmd[2:]), flush=True)
    start = time.perf_counter()
    rc = subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return rc, time.perf_counter() - start


def row(label: str, summary: dict, wall_s: float) -> str:
    mem = summary["memory"]
    static_mib = sum(mem[k] for k in ("params_bytes", "grads_bytes", "optim_bytes")) / 2**20
    quality = f"{summary['eval_acc']:.2%} acc" if "eval_acc" in summary else f"{summary['eval_loss']:.3f} loss"
    unit = summary["throughput_unit"]
    return (
        f"| {label} | {summary['steps']} | {summary['train_loss']:.3f} | {quality} | "
        f"{summary['tokens_or_samples_per_s']:.0f} {unit} | {static_mib:.1f} | "
        f"{summary['comm_bytes_per_step'] / 2**20:.2f} | {wall_s:.0f} |"
    )


def main() -> int:
    extra = sys.argv[1:]
    root = Path("outputs") / "demo" / time.strftime("%Y%m%d-%H%M%S")
    lines = [
        f"| run ({NPROC} CPU processes) | steps | train loss | eval | throughput "
        "| params+grads+optim MiB/rank | comm MiB/step | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    failed = []
    for i, (label, overrides) in enumerate(VARIANTS):
        run_dir = root / f"{i}-{overrides[0].split('=', 1)[1]}"
        rc, wall = launch(overrides + extra, run_dir)
        summary_path = run_dir / "summary.json"
        if rc != 0 or not summary_path.exists():
            failed.append(label)
            lines.append(f"| {label} | failed (exit {rc}) | | | | | | {wall:.0f} |")
            continue
        lines.append(row(label, json.loads(summary_path.read_text()), wall))
    table = "\n".join(lines)
    root.mkdir(parents=True, exist_ok=True)
    (root / "results.md").write_text(table + "\n")
    print(f"\n{table}\n\nrun dirs under {root}/")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
