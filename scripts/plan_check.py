"""The slow check of a plan: every peak `sdp.plan` printed against `sdp.estimate` on that row's command.

    python scripts/plan_check.py PLAN_DIR/plan.json [--sample N] [--rows PATTERN ...] [--out FILE.json]

For each row that fits (or the first N of the ranking, or those whose name matches a --rows
pattern, fnmatch), the row's command line is loaded as
`sdp.estimate` loads it (the same overrides, world_size = the plan's) and every rank the planner
traced is estimated whole: every layer, every accumulation step. Prints each row's largest
relative difference and the worst; exits 1 when any is over 3% (the planner's promise,
docs/plan.md). A whole llama_1b trace takes 5 to 60 s here: the 45 rows of the 8 x 80 GB
example took 9 minutes (`make plan-check`). With --rows and an --out file that exists, the rows
checked replace theirs in it and the others are kept (after a change that moves some rows).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from fnmatch import fnmatch
from pathlib import Path

from sdp.planning.estimator import estimate
from sdp.run.config import load_config

TOLERANCE = 0.03


def check_row(row: dict, world: int) -> float:
    """The largest relative difference between the row's peaks and the whole estimates."""
    overrides = shlex.split(row["command"])[3:]
    overrides = [a for a in overrides if not a.startswith("--")]  # the launcher's options
    cfg = load_config(overrides, world_size=world, offline=True, check_data=False)
    worst = 0.0
    for rank, predicted in row["peaks_bytes"].items():
        whole = estimate(cfg, world_size=world, rank=int(rank)).memory["peak_with_comm_groups_bytes"]
        worst = max(worst, abs(predicted - whole) / whole)
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--sample", type=int, default=0, help="only the first N rows of the ranking (0: all)")
    parser.add_argument("--rows", nargs="+", metavar="PATTERN", help="only the rows whose name matches (fnmatch)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    plan = json.loads(args.plan.read_text())
    world = len(plan["devices_gib"])
    names = plan["ranked"][: args.sample] if args.sample else plan["ranked"]
    if args.rows:
        names = [n for n in names if any(fnmatch(n, p) for p in args.rows)]
    rows = {r["run"]: r for r in plan["rows"]}
    results = []
    for i, name in enumerate(names, 1):
        start = time.perf_counter()
        diff = check_row(rows[name], world)
        results.append({"run": name, "relative_difference": diff})
        print(f"[{i}/{len(names)}] {name}: {diff:.4%} ({time.perf_counter() - start:.0f} s)", flush=True)
    worst = max((r["relative_difference"] for r in results), default=0.0)
    print(f"worst: {worst:.4%} over {len(results)} rows (tolerance {TOLERANCE:.0%})")
    if args.out is not None:
        write(args.out, plan=args.plan, results=results, keep=bool(args.rows))
    return 1 if worst > TOLERANCE else 0


def write(out: Path, *, plan: Path, results: list[dict], keep: bool) -> None:
    """The check's JSON; with `keep`, the rows of an earlier check that were not checked again
    stay, in their order, and the worst is over all of them."""
    checked = {r["run"]: r for r in results}
    if keep and out.exists():
        before = json.loads(out.read_text())["rows"]
        results = [checked.pop(r["run"], r) for r in before] + list(checked.values())
    worst = max((r["relative_difference"] for r in results), default=0.0)
    out.write_text(json.dumps({"plan": str(plan), "rows": results, "worst": worst}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
