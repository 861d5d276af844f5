"""The offline demo behind `make run`: DDP against SDP on real data, 4 CPU processes.

ResNet (torchvision, 4.9M parameters) on Fashion-MNIST, the same steps and
data for every variant: DDP, then SDP at coverage 0.5 (each unit held by 2 of
the 4 workers) with backward and forward masking, at neuron and block level.
`--text` runs the same comparison for LLaMA on the Python standard library's
sources. Extra arguments are overrides for every run, e.g. trainer.max_steps=50.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from sdp.launching.variants import comparison_table, run_variants

NPROC = 4
SUITES = {
    "vision": ("Fashion-MNIST / resnet_tiny", ["experiment=demo_fmnist"]),
    "text": ("stdlib text / llama_tiny", ["experiment=demo_text"]),
}
VARIANTS = [
    ("DDP", ["masking=none"]),
    ("N-SDP backward C=0.5", ["masking=backward", "masking.granularity=neuron", "masking.coverage=0.5"]),
    ("N-SDP forward C=0.5", ["masking=forward", "masking.granularity=neuron", "masking.coverage=0.5"]),
    ("B-SDP backward C=0.5", ["masking=backward", "masking.granularity=block", "masking.coverage=0.5"]),
    ("B-SDP forward C=0.5", ["masking=forward", "masking.granularity=block", "masking.coverage=0.5"]),
]


def main(argv: list[str]) -> int:
    suite = "text" if "--text" in argv else "vision"
    extra = [a for a in argv if a != "--text"]
    title, base = SUITES[suite]
    root = Path("outputs") / "demo" / f"{time.strftime('%Y%m%d-%H%M%S')}-{suite}"
    results = run_variants(base + ["trainer.progress=false", *extra], VARIANTS, root=root, nproc=NPROC)
    table = f"{title}, {NPROC} CPU processes, the same steps and data for every row\n\n{comparison_table(results)}"
    root.mkdir(parents=True, exist_ok=True)
    (root / "results.md").write_text(table + "\n")
    print(f"\n{table}\n\nrun dirs under {root}/")
    failed = [r.label for r in results if r.summary is None]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
