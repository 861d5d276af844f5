"""Make tests/data/bits_k4.json: what a version of the code trains, bit for bit, in every
overlapped K = 4, C = 0.5 case of tests/dist_harness.py (losses, parameters, optimizer state).

    python scripts/make_bits.py CHECKOUT OUT.json

CHECKOUT is a checkout of the version (`git worktree add /tmp/before REV`); its tests/ and src/
run the harness, with the CPU kernels pinned as the test pins them (conftest.PINNED_KERNELS),
so the bits do not depend on this CPU's own kernels. The file's `made_by` says which version.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    root, out = Path(argv[0]).resolve(), Path(argv[1]).resolve()
    sys.path[:0] = [str(root / "tests"), str(root / "src")]
    os.environ["PYTHONPATH"] = f"{root / 'tests'}:{root / 'src'}"  # the forked ranks' too
    os.environ.update({"MKL_CBWR": "AVX2,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"})  # conftest.PINNED_KERNELS
    from conftest import run_harness  # the version's own (its ranks inherit this environment)

    res = run_harness("holders", 4, out.parent / f"{out.stem}.holders.json")
    cases = {case: r["bits"] for case, r in res["overlap"].items() if isinstance(r, dict) and "bits" in r}
    out.write_text(json.dumps({"cases": cases}, indent=1, sort_keys=True) + "\n")
    print(f"{len(cases)} cases -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
