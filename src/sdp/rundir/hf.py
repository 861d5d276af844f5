"""Trained models out of the framework, in their ecosystems' own formats (`trainer.export`).

A LLaMA goes to `RUN_DIR/hf/` as transformers writes a `LlamaForCausalLM`: `config.json`,
`generation_config.json` and `model.safetensors`, so `AutoModelForCausalLM.from_pretrained(RUN_DIR
/ "hf")` loads it (offline) and lm-evaluation-harness can evaluate it. A vision model goes to the
same folder as `model.safetensors` with `builder.json`: the library and the arguments that build
it without sdp (torchvision's ResNet and its stem, or timm's name and keyword arguments), and the
preprocessing the run's evaluation gave its images. Both are made from `model.pt`, the run's final
evaluated model (assembled under SDP, with its evaluation scaling folded in): the exported model
computes what the run evaluated. A text run's tokenizer goes there too (tokenizer.json and its
config, as a PreTrainedTokenizerFast that transformers 4.x and 5.x load), so
`AutoTokenizer.from_pretrained(RUN_DIR / "hf")` encodes text into the ids the run trained on, and
the model's bos/eos/pad ids are that tokenizer's own special tokens (`generate()` stops at its end
of text). docs/export.md describes every file and field.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file
from tokenizers import Tokenizer

from sdp.data import DataConfig, cifar, data_tokenizer_file, fashion_mnist, synthetic
from sdp.data.tokenizer import TextTokenizer, wrap_tokenizer
from sdp.models import LlamaConfig, ModelConfig, build_model, build_on_meta, vision_builder
from sdp.rundir.files import CONFIG, MODEL, write_json_atomic

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

EXPORT_DIR = "hf"
# Spellings of a beginning-of-text special token. A tokenizer without one (GPT-2's, the BPE that
# local_text trains) begins with its end-of-text token, as GPT-2 does: the runs pack documents
# separated by EOS and prepend nothing, so EOS is what the model saw before a document.
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>")
# The class written into tokenizer_config.json: transformers 5.x writes its internal name
# (TokenizersBackend), which 4.x's AutoTokenizer does not know; both load this one.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"
# Channels of every vision model's input: sdp.data.images.normalize repeats grey images to 3, and
# both families take 3 (the ResNet's conv1 in builder.json, timm's default in_chans).
MODEL_CHANNELS = 3
# Pixels are 0..255 and divided by this before the mean and std (torchvision's ToTensor, or
# sdp.data.images.normalize).
PIXEL_SCALE = 255


def export_model(
    run_dir: Path,
    model_cfg: ModelConfig,
    *,
    tokenizer: Path | None = None,
    eos_token: str | None = None,
    dataset: DataConfig | None = None,
) -> Path:
    """Write `run_dir/hf/` from `run_dir/model.pt` in the model family's standard format, with
    the run's `tokenizer` (its tokenizer.json; `eos_token` as dataset.eos_token) for a LLaMA, and
    the image preprocessing of `dataset` (default: the dataset of `run_dir/config.yaml`, which
    every run dir has) for a vision model."""
    out = run_dir / EXPORT_DIR
    out.mkdir(exist_ok=True)
    if isinstance(model_cfg, LlamaConfig):
        export_llama(out, run_dir / MODEL, model_cfg, tokenizer=tokenizer, eos_token=eos_token)
        return out
    with torch.device("cpu"):
        model = build_model(model_cfg)
    model.load_state_dict(torch.load(run_dir / MODEL, map_location="cpu", weights_only=True), strict=True)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    spec = vision_builder(model_cfg)
    spec["preprocessing"] = image_preprocessing(dataset if dataset is not None else run_dataset(run_dir))
    write_json_atomic(out / "builder.json", spec)
    return out


def export_llama(out: Path, weights: Path, cfg: LlamaConfig, *, tokenizer: Path | None, eos_token: str | None) -> None:
    """The weights as transformers' own LlamaForCausalLM (sdp's subclass would name itself in
    config.json's `architectures`, a class nothing outside sdp has), with its default attention
    (sdp's causal SDPA is registered only inside sdp) and its KV cache on for generate(); the
    bos/eos/pad ids are the exported tokenizer's, or none without a tokenizer (transformers'
    defaults, 1 and 2, are ordinary tokens of ours)."""
    import transformers

    config = copy.deepcopy(build_on_meta(cfg).config)  # sdp's model's transformers config (the meta model's is shared)
    fast = None
    if tokenizer is not None:
        fast = hf_tokenizer(
            tokenizer, eos_token=eos_token, vocab_size=config.vocab_size, max_length=config.max_position_embeddings
        )
    config._attn_implementation = "sdpa"
    config.use_cache = True
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, name, getattr(fast, name) if fast is not None else None)
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(config)  # its generation_config takes the ids above
    model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True), strict=True)
    with quiet_progress_bars():
        model.save_pretrained(out)
    if fast is not None:
        save_tokenizer(out, fast)


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """No transformers progress bar inside (save_pretrained's "Writing model shards" would land
    in every run's output). Through transformers' tqdm hook, restored after, not its global
    switch (disable_progress_bar), which would also silence the hub's downloads for the rest of
    the process."""
    from transformers.utils import logging as hf_logging

    def disabled(factory, args, kwargs):
        kwargs = {**kwargs, "disable": True}
        return previous(factory, args, kwargs) if previous is not None else factory(*args, **kwargs)

    previous = hf_logging.set_tqdm_hook(disabled)
    try:
        yield
    finally:
        hf_logging.set_tqdm_hook(previous)


def special_tokens(tok: TextTokenizer) -> dict[str, str]:
    """The tokenizer's own special tokens by transformers' names: its end of text as eos and pad,
    and as bos unless it has a distinct beginning-of-text special token; its unknown token."""
    eos = tok.tokenizer.id_to_token(tok.eos_id)
    special = {added.content for added in tok.tokenizer.get_added_tokens_decoder().values() if added.special}
    bos = next((name for name in BOS_CANDIDATES if name in special and name != eos), eos)
    names = {"bos_token": bos, "eos_token": eos, "pad_token": eos}
    if tok.unk_id is not None:
        names["unk_token"] = tok.tokenizer.id_to_token(tok.unk_id)
    return names


def hf_tokenizer(
    path: Path, *, eos_token: str | None, vocab_size: int, max_length: int
) -> PreTrainedTokenizerFast | None:
    """The run's tokenizer as transformers' PreTrainedTokenizerFast, encoding as the run did
    (special-token text is spelled in ordinary tokens, nothing added around a text), with its
    special tokens named and the model's context as `model_max_length`; None, with one line, when
    it has ids the model has no embedding for."""
    from transformers import PreTrainedTokenizerFast  # ~1 s: only a LLaMA run's export pays it

    tok = wrap_tokenizer(Tokenizer.from_file(str(path)), eos_token=eos_token)
    if tok.size > vocab_size:
        print(
            f"warning: the tokenizer ({path}) is not exported: its {tok.size} ids exceed the model's "
            f"{vocab_size} (dataset.vocab_size cut them; the run mapped the rest to the unknown token)",
            file=sys.stderr,
        )
        return None
    return PreTrainedTokenizerFast(
        tokenizer_object=tok.tokenizer, split_special_tokens=True, model_max_length=max_length, **special_tokens(tok)
    )


def save_tokenizer(out: Path, fast: PreTrainedTokenizerFast) -> None:
    """tokenizer.json and tokenizer_config.json, the latter naming a class that transformers 4.x
    loads too (5.x writes its internal TokenizersBackend, and a `backend` key 4.x does not know)."""
    fast.save_pretrained(out)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = TOKENIZER_CLASS
    config.pop("backend", None)
    write_json_atomic(path, config)


def run_dataset(run_dir: Path) -> DataConfig:
    """The dataset config of the run, from its config.yaml's dataset section, typed as
    sdp.run.config.to_typed types it (importing that module from here would make a cycle)."""
    section = OmegaConf.load(run_dir / CONFIG).dataset
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), section))


def image_preprocessing(data: DataConfig) -> dict:
    """builder.json's `preprocessing`: what the run's evaluation did to the dataset's images before
    the model saw them, from its dataset config and its dataset module's constants (docs/export.md
    names each field and the order they apply in). The mean and std have one value per channel the
    model sees (a grey image's repeated)."""
    mode, mean, std, pad, resize, crop = eval_transform(data)
    repeat = MODEL_CHANNELS // len(mean)
    return {
        "dataset": data.name,
        "color_mode": mode,
        "in_channels": MODEL_CHANNELS,
        "image_size": data.image_size,
        "resize": resize,
        "center_crop": crop,
        "pad": pad,
        "pixel_scale": PIXEL_SCALE,
        "mean": [float(m) for m in mean] * repeat,
        "std": [float(s) for s in std] * repeat,
    }


def eval_transform(data: DataConfig) -> tuple[str, tuple, tuple, int, dict | None, int | None]:
    """(color mode, mean, std, zero padding, resize, center crop) of the dataset's evaluation
    images, as its module (sdp.data.<name>) makes them; ValueError for a dataset it does not know,
    so that a new image dataset cannot export without saying its preprocessing."""
    if data.name == "fashion_mnist":  # 28x28 grey, zero-padded to 32x32
        return "L", fashion_mnist.MEAN, fashion_mnist.STD, fashion_mnist.PAD, None, None
    if data.name in cifar.VARIANTS:
        variant = cifar.VARIANTS[data.name]
        return "RGB", variant.mean, variant.std, 0, None, None
    if data.name == "synthetic_image":
        return "RGB", synthetic.PIXEL_MEAN, synthetic.PIXEL_STD, 0, None, None
    if data.name == "imagenet":
        return folder_eval_transform(data.image_size)
    raise ValueError(f"dataset.name={data.name!r}: the export does not know its images' preprocessing")


def folder_eval_transform(size: int) -> tuple[str, tuple, tuple, int, dict | None, int | None]:
    """eval_transform of ImageNet, read from the torchvision transforms its evaluation runs
    (sdp.data.image_folder.eval_transform; PIL images in RGB, as ImageFolder loads them)."""
    from torchvision import transforms

    from sdp.data.image_folder import eval_transform as folder_transform

    steps = {type(step): step for step in folder_transform(size).transforms}
    resize, crop, norm = steps[transforms.Resize], steps[transforms.CenterCrop], steps[transforms.Normalize]
    resized = {"shorter_side": resize.size, "interpolation": resize.interpolation.value, "antialias": resize.antialias}
    return "RGB", tuple(norm.mean), tuple(norm.std), 0, resized, crop.size[0]


def export_run_dir(run_dir: Path, model_cfg: ModelConfig, data_cfg: DataConfig) -> None:
    """`export_model` with the run's tokenizer and image preprocessing, from its dataset config
    (the end of a run, and `python -m sdp.export`); an export that fails (a full disk) removes
    hf/ rather than leave it half-written, and raises."""
    try:
        export_model(
            run_dir, model_cfg, tokenizer=data_tokenizer_file(data_cfg), eos_token=data_cfg.eos_token, dataset=data_cfg
        )
    except BaseException:
        shutil.rmtree(run_dir / EXPORT_DIR, ignore_errors=True)
        raise


def exported_files(run_dir: Path) -> list[str]:
    """The files of the run's export (relative to the run dir), for summary.json."""
    out = run_dir / EXPORT_DIR
    return sorted(str(p.relative_to(run_dir)) for p in out.iterdir()) if out.is_dir() else []
