"""`python -m sdp.export RUN_DIR [RUN_DIR ...]`: write RUN_DIR/hf/ for runs that exist, from
their model.pt and config.yaml, as `trainer.export=hf` does at the end of a run (see
`sdp.rundir.hf`): a transformers LlamaForCausalLM for LLaMA, with the run's tokenizer
where this machine has it (its dataset's cache or path), safetensors and builder.json (with
the run's image preprocessing) for the vision models; docs/export.md describes the files."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from sdp import rundir
from sdp.errors import ConfigError
from sdp.launching.cli import wants_help
from sdp.paths import DamagedFile, describe
from sdp.run.config import run_config
from sdp.rundir import write_error
from sdp.rundir.hf import EXPORT_DIR, export_run_dir, exported_files


def export_run(run_dir: Path) -> list[str]:
    """Export one run dir; ConfigError (naming it) when it has no model.pt or config.yaml,
    DamagedFile when one cannot be read, and one line (hf/ removed, not left half-written)
    when the export cannot be written."""
    for name in (rundir.MODEL, rundir.CONFIG):
        if not (run_dir / name).is_file():
            raise ConfigError("RUN_DIR", str(run_dir), f"has no {name} (a finished run with trainer.save_model=true)")
    cfg = run_config(run_dir / rundir.CONFIG)
    try:
        torch.load(run_dir / rundir.MODEL, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 - any way a file can fail to load is one line
        raise DamagedFile(run_dir / rundir.MODEL, f"cannot be loaded ({describe(err)})") from None
    try:
        export_run_dir(run_dir, cfg.model, cfg.dataset)
    except (OSError, RuntimeError, ValueError) as err:  # a full disk; a model.pt of another shape
        raise DamagedFile(run_dir / EXPORT_DIR, f"not written: {write_error(err, run_dir / EXPORT_DIR)}") from None
    return exported_files(run_dir)


USAGE = """usage: python -m sdp.export RUN_DIR [RUN_DIR ...]   (or sdp-export)

Write RUN_DIR/hf/ for finished runs, from their model.pt and config.yaml, as trainer.export=hf
does at the end of a run: a transformers LlamaForCausalLM for LLaMA (with the run's tokenizer
where this machine has it), safetensors and builder.json for the vision models. A run dir that
has no model.pt, or whose files cannot be read, is one error line naming it; docs/export.md
describes the files.

Examples:
  python -m sdp.export outputs/llama_tiny-synthetic_text-none
  sdp-export runs/*/"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(USAGE)
        return 0
    if not argv:
        print(
            f"error: {ConfigError('RUN_DIR', None, 'is required: python -m sdp.export RUN_DIR ... (--help)')}",
            file=sys.stderr,
        )
        return 2
    for arg in argv:
        try:
            files = export_run(Path(arg))
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"{arg}: {', '.join(files)}")
    return 0


def cli() -> None:
    """The `sdp-export` console script."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
