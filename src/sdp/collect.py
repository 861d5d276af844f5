"""Paper tables and plots from run dirs: `python -m sdp.collect ROOT [ROOT ...] --out DIR`.

The command (and `sdp-collect`): its options, the inputs checked before anything is written, then
`sdp.analysis.tables.collect`, which says what each written file holds. A bad input or a damaged
file is one `error:` line and exit code 2, with nothing written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sdp.analysis.tables import CLAIMS_FILE, collect
from sdp.errors import ConfigError
from sdp.paths import DamagedFile, check_writable
from sdp.rundir import write_error


class OneLineParser(argparse.ArgumentParser):
    """A wrong option is one `error:` line naming it (argparse prints its usage and a second line)."""

    def error(self, message: str):
        raise BadOptions(message)


class BadOptions(ValueError):
    pass


EXAMPLES = """examples:
  python -m sdp.collect outputs/ --out results/tables
  python -m sdp.collect runs/table1 runs/table2 --out results/tables --claims --memory-table est.csv"""


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog="python -m sdp.collect",
        description=__doc__.split("\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("roots", nargs="+", type=Path, help="directories holding run dirs (searched recursively)")
    parser.add_argument("--out", type=Path, default=Path("results/tables"), help="default: %(default)s")
    parser.add_argument("--no-plots", action="store_true", help="tables only, no PNG plots")
    parser.add_argument("--claims", action="store_true", help=f"also write OUT/{CLAIMS_FILE}: the paper's claims")
    parser.add_argument("--memory-table", type=Path, help="the estimator's memory table (.csv) for the memory claims")
    parser.add_argument("--cuda", type=Path, nargs="*", default=[], help="CUDA memory measurements (.json)")
    parser.add_argument("--wandb", action="store_true", help="also log the tables, plots and claims to one W&B run")
    parser.add_argument("--wandb-project", default="sdp")
    parser.add_argument("--wandb-mode", choices=["offline", "online"], default="offline")
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parser.parse_args(argv)
    except BadOptions as err:
        print(f"error: {ConfigError('options', ' '.join(argv), f'{err} (--help for the usage)')}", file=sys.stderr)
        return 2
    except SystemExit as done:  # --help: printed
        return int(done.code or 0)
    command = "python -m sdp.collect " + " ".join(argv)
    try:
        for path in [args.memory_table, *args.cuda]:
            if path is not None and not path.is_file():
                raise DamagedFile(path, "no such file")
        check_writable("--out", args.out)
        written = collect(
            args.roots,
            args.out,
            command=command,
            make_plots=not args.no_plots,
            claims=args.claims,
            memory_table=args.memory_table,
            cuda=tuple(args.cuda),
            wandb_project=args.wandb_project if args.wandb else None,
            wandb_mode=args.wandb_mode,
        )
    except ConfigError as err:  # a bad input or file: one line, nothing written
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # --out filled up or went away while writing
        print(f"error: {write_error(err, args.out)}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
