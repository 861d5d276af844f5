"""`python -m sdp.export RUN_DIR [RUN_DIR ...]`: write RUN_DIR/hf/ for runs that exist, from
their model.pt and config.yaml, as `trainer.export=hf` does at the end of a run (see
`sdp.rundir.export`): a transformers LlamaForCausalLM for LLaMA, with the run's tokenizer
where this machine has it (its dataset's cache or path), safetensors and builder.json (with
the run's image preprocessing) for the vision models; docs/export.md describes the files."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

from sdp import rundir
from sdp.config import to_typed
from sdp.data import data_tokenizer_file
from sdp.errors import ConfigError
from sdp.rundir.export import export_model, exported_files


def export_run(run_dir: Path) -> list[str]:
    """Export one run dir; ConfigError (naming it) when it has no model.pt or config.yaml."""
    for name in (rundir.MODEL, rundir.CONFIG):
        if not (run_dir / name).is_file():
            raise ConfigError("RUN_DIR", str(run_dir), f"has no {name} (a finished run with trainer.save_model=true)")
    cfg = to_typed(OmegaConf.load(run_dir / rundir.CONFIG))
    export_model(
        run_dir,
        cfg.model,
        tokenizer=data_tokenizer_file(cfg.dataset),
        eos_token=cfg.dataset.eos_token,
        dataset=cfg.dataset,
    )
    return exported_files(run_dir)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    for arg in argv:
        try:
            files = export_run(Path(arg))
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"{arg}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
