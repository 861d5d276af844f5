"""The spectral gap ρ against convergence (issue 17): the same runs but for their masks.

    python scripts/rho_convergence.py [--runs outputs/rho] [--out results/cpu_replica]
                                      [--seeds 0 1 2] [--smoke] [OVERRIDES ...]

ResNet on Fashion-MNIST with K = 4 CPU workers at C = 0.5 (N-SDP, neuron units), the same
data and seeds for every run, evaluated every tenth of its steps on a third of the test
set (25 batches of 32 per rank). Per seed: DDP, then
backward and forward masking with three constructions of very different mixing:

- cyclic: worker k holds chunks k, k+1 (a ring of holder pairs);
- random: holders drawn per chunk, a new draw per seed (masking.seed = the run's seed, or
  the next admissible draw where forward masking refuses one: `admissible_mask_seed`);
- blocked: workers {0, 1} and {2, 3} never share a unit (ρ = 0).

Writes OUT/rho_convergence.md (ρ, final eval loss, steps to reach DDP's eval loss at half
its budget) and OUT/rho_convergence.png. Completed runs are skipped on the next call.
--smoke: 8 steps and one seed into a temporary directory, to rehearse the pipeline.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from sdp.analysis.rho import ddp_target, rho_markdown, rho_plot, rho_points
from sdp.analysis.tables import find_runs
from sdp.errors import ConfigError
from sdp.launching.sweep import run_sweep
from sdp.run.config import load_config

NPROC = 4
MODES = "n_sdp_backward,n_sdp_forward"
STEPS = 160
EVAL_BATCHES = 25


def sweeps(seed: int, steps: int, *, every: int, eval_batches: int) -> dict[str, list[str]]:
    base = ["experiment=demo_fmnist", f"trainer.max_steps={steps}", f"trainer.eval_every={every}"]
    base += [f"dataset.eval_batches={eval_batches}", "trainer.progress=false", "logger=none", f"seed={seed}"]
    sdp = [*base, "masking.coverage=0.5"]
    out = {"ddp": [*base, "variant=ddp"], "sdp": [*sdp, f"variant={MODES}", "masking.construction=cyclic,blocked"]}
    for variant in MODES.split(","):
        random = [*sdp, f"variant={variant}", "masking.construction=random"]
        out[f"random_{variant}"] = [*random, f"masking.seed={admissible_mask_seed(random, seed)}"]
    return out


def admissible_mask_seed(overrides: list[str], seed: int) -> int:
    """The first random draw, from mask seed `seed` on in steps of 1000, that the config accepts:
    under forward masking a draw that leaves a worker no unit of some layer is refused (the
    subnetwork would have no path from input to loss), and the next one is taken."""
    for tries in range(50):
        candidate = seed + 1000 * tries
        try:
            load_config([*overrides, f"masking.seed={candidate}"], world_size=NPROC, offline=True, check_data=False)
            return candidate
        except ConfigError:
            continue
    raise SystemExit(f"error: no admissible random mask in 50 draws from masking.seed={seed}: {' '.join(overrides)}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=Path, default=Path("outputs/rho"))
    parser.add_argument("--out", type=Path, default=Path("results/cpu_replica"))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--smoke", action="store_true")
    args, extra = parser.parse_known_args(argv)
    steps, seeds = (8, [0]) if args.smoke else (STEPS, args.seeds)
    # Ten evaluations a run, each of EVAL_BATCHES batches per rank (a third of the test set).
    every, eval_batches = (4, 2) if args.smoke else (STEPS // 10, EVAL_BATCHES)
    runs = Path(tempfile.mkdtemp(prefix="rho-smoke-")) if args.smoke else args.runs
    out = runs / "results" if args.smoke else args.out
    failed = 0
    for seed in seeds:
        for name, overrides in sweeps(seed, steps, every=every, eval_batches=eval_batches).items():
            where = runs / f"seed{seed}" / name
            failed += (
                run_sweep([*overrides, *extra, f"sweep.nproc={NPROC}", f"sweep.dir={where}", "sweep.name=rho"]) != 0
            )
    found = find_runs([runs])
    ddp = [(d, s) for d, s in found if s.masking == "none" and s.status == "completed"]
    target = ddp_target(ddp)
    points = rho_points(found, target[1])
    command = "python scripts/rho_convergence.py" + (" --smoke" if args.smoke else "")
    out.mkdir(parents=True, exist_ok=True)
    md = out / "rho_convergence.md"
    md.write_text(rho_markdown(points, target=target, ddp_final=[s.eval_loss for _, s in ddp], command=command))
    print(f"wrote {md}\nwrote {rho_plot(points, out / 'rho_convergence.png', budget=steps)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
