"""Trained models out of the framework, in their ecosystems' own formats (`trainer.export`).

A LLaMA goes to `RUN_DIR/hf/` as transformers writes a `LlamaForCausalLM`: `config.json`
and `model.safetensors`, so `AutoModelForCausalLM.from_pretrained(RUN_DIR / "hf")` loads it
(offline) and lm-evaluation-harness can evaluate it. A vision model goes to the same folder
as `model.safetensors` with `builder.json`: the library and the arguments that build it
without sdp (torchvision's ResNet and its stem, or timm's name and keyword arguments). Both
are made from `model.pt`, the run's final evaluated model (assembled under SDP, with its
evaluation scaling folded in): the exported model computes what the run evaluated.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from sdp.models import LlamaConfig, ModelConfig, build_model, vision_builder
from sdp.rundir.files import MODEL, write_json_atomic

EXPORT_DIR = "hf"


def export_model(run_dir: Path, model_cfg: ModelConfig) -> Path:
    """Write `run_dir/hf/` from `run_dir/model.pt` in the model family's standard format."""
    with torch.device("cpu"):
        model = build_model(model_cfg)
    model.load_state_dict(torch.load(run_dir / MODEL, map_location="cpu", weights_only=True), strict=True)
    out = run_dir / EXPORT_DIR
    out.mkdir(exist_ok=True)
    if isinstance(model_cfg, LlamaConfig):
        # The class transformers knows, with its default attention (sdp's own causal SDPA is
        # registered only inside sdp); the weights and their names are unchanged.
        model.config.architectures = ["LlamaForCausalLM"]
        model.config._attn_implementation = "sdpa"
        model.save_pretrained(out, safe_serialization=True)
        return out
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    write_json_atomic(out / "builder.json", vision_builder(model_cfg))
    return out


def exported_files(run_dir: Path) -> list[str]:
    """The files of the run's export (relative to the run dir), for summary.json."""
    out = run_dir / EXPORT_DIR
    return sorted(str(p.relative_to(run_dir)) for p in out.iterdir()) if out.is_dir() else []
