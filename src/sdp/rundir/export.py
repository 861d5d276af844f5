"""Trained models out of the framework, in their ecosystems' own formats (`trainer.export`).

A LLaMA goes to `RUN_DIR/hf/` as transformers writes a `LlamaForCausalLM`: `config.json`
and `model.safetensors`, so `AutoModelForCausalLM.from_pretrained(RUN_DIR / "hf")` loads it
(offline) and lm-evaluation-harness can evaluate it. A vision model goes to the same folder
as `model.safetensors` with `builder.json`: the library and the arguments that build it
without sdp (torchvision's ResNet and its stem, or timm's name and keyword arguments). Both
are made from `model.pt`, the run's final evaluated model (assembled under SDP, with its
evaluation scaling folded in): the exported model computes what the run evaluated. A text
run's tokenizer goes there too (tokenizer.json and its config, as transformers writes a
PreTrainedTokenizerFast), so `AutoTokenizer.from_pretrained(RUN_DIR / "hf")` encodes text
into the ids the run trained on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from sdp.data.tokenizer import wrap_tokenizer
from sdp.models import LlamaConfig, ModelConfig, build_model, vision_builder
from sdp.rundir.files import MODEL, write_json_atomic

EXPORT_DIR = "hf"


def export_model(run_dir: Path, model_cfg: ModelConfig, *, tokenizer: Path | None = None, eos_token=None) -> Path:
    """Write `run_dir/hf/` from `run_dir/model.pt` in the model family's standard format, with
    the run's `tokenizer` (its tokenizer.json; `eos_token` as dataset.eos_token) for a LLaMA."""
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
        if tokenizer is not None:
            export_tokenizer(out, tokenizer, eos_token=eos_token, vocab_size=model.config.vocab_size)
        return out
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    write_json_atomic(out / "builder.json", vision_builder(model_cfg))
    return out


def export_tokenizer(out: Path, path: Path, *, eos_token: str | None, vocab_size: int) -> bool:
    """Write the tokenizer into `out` as transformers' PreTrainedTokenizerFast, encoding as the
    run did (special-token text is spelled in ordinary tokens, nothing added around a text);
    refused, with one line, when it has ids the model has no embedding for."""
    from transformers import PreTrainedTokenizerFast  # ~1 s: only a LLaMA run's export pays it

    tok = wrap_tokenizer(Tokenizer.from_file(str(path)), eos_token=eos_token)
    if tok.size > vocab_size:
        print(
            f"warning: the tokenizer ({path}) is not exported: its {tok.size} ids exceed the model's "
            f"{vocab_size} (dataset.vocab_size cut them; the run mapped the rest to the unknown token)",
            file=sys.stderr,
        )
        return False
    names = {"eos_token": tok.tokenizer.id_to_token(tok.eos_id)}
    if tok.unk_id is not None:
        names["unk_token"] = tok.tokenizer.id_to_token(tok.unk_id)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok.tokenizer, split_special_tokens=True, **names)
    fast.save_pretrained(out)
    return True


def exported_files(run_dir: Path) -> list[str]:
    """The files of the run's export (relative to the run dir), for summary.json."""
    out = run_dir / EXPORT_DIR
    return sorted(str(p.relative_to(run_dir)) for p in out.iterdir()) if out.is_dir() else []
