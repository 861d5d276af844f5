"""Plain models, built from their upstream libraries.

Models know nothing of masking or parallelism: SDP, DDP and FSDP are applied
from outside (see `sdp.subnet` and `sdp.parallel`). Each family has its own
small config; `build_model` dispatches on `family`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from sdp.errors import ConfigError
from sdp.models.loss import Loss


@dataclass
class LlamaConfig:
    """A LLaMA decoder (transformers `LlamaForCausalLM`), untied by default."""

    name: str = "llama"
    family: str = "llama"
    hidden_size: int = 768
    intermediate_size: int = 2048
    num_layers: int = 12
    num_heads: int = 12
    num_kv_heads: int = 12
    vocab_size: int = 32000
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    init_std: float = 0.02
    # The loss: chunked computes the LM head and the cross-entropy loss_chunk_tokens tokens at a
    # time (no full-size fp32 logits in the forward or backward; see sdp.models.loss); full
    # makes every token's logits at once.
    loss: Loss = Loss.chunked
    loss_chunk_tokens: int = 1024
    # Scales the widths neuron SDP slices (see `INNER_WIDTH`): intermediate_size and the KV groups,
    # with the query heads of each group and the head dimension, hidden_size / num_heads, kept.
    inner_width: float = 1.0


@dataclass
class ResNetConfig:
    """A torchvision ResNet of BasicBlocks, with a configurable stem for small images."""

    name: str = "resnet"
    family: str = "resnet"
    layers: list[int] = field(default_factory=lambda: [2, 2, 2, 2])
    num_classes: int = 10
    # The CIFAR variant: a 3x3 stride-1 stem and no max-pool keeps 32x32 inputs
    # at full resolution in the first stage (He et al. 2016, Sec. 4.2 practice).
    stem_kernel: int = 3
    stem_stride: int = 1
    stem_pool: bool = False
    # The first stage's width: the stages are base_width x (1, 2, 4, 8) channels (torchvision's
    # 64, 128, 256, 512 at 64), the stem's output the first stage's.
    base_width: int = 64
    # Scales the widths neuron SDP slices (see `INNER_WIDTH`): every BasicBlock's inner channels
    # (conv1's outputs, conv2's inputs); the stages' widths are kept.
    inner_width: float = 1.0


@dataclass
class SwinConfig:
    """A timm Swin Transformer; `img_size`/`patch_size`/`window_size` adapt it to 32x32."""

    name: str = "swin"
    family: str = "swin"
    img_size: int = 32
    patch_size: int = 2
    window_size: int = 4
    embed_dim: int = 96
    depths: list[int] = field(default_factory=lambda: [2, 2, 6, 2])
    num_heads: list[int] = field(default_factory=lambda: [3, 6, 12, 24])
    mlp_ratio: float = 4.0
    drop_path_rate: float = 0.0
    num_classes: int = 10
    # Scales the widths neuron SDP slices (see `INNER_WIDTH`): every block's MLP hidden units and
    # its heads, the head dimension (the same in every stage) kept.
    inner_width: float = 1.0


# model.inner_width: the widths that neuron SDP's units slice, scaled by a factor w, and nothing
# else (embeddings, the residual stream, stems, norms and classifiers keep their sizes). At
# w = C the dense model has exactly the tensors of the subnetwork that forward masking at
# coverage C gives each worker, when the worker count divides every group's units, so DDP
# trains the same-size dense control (docs/sdp.md, "The dense control"). Every scaled count must
# be a whole number >= 1.
INNER_WIDTH = "model.inner_width"


ModelConfig = LlamaConfig | ResNetConfig | SwinConfig

FAMILIES: dict[str, type] = {"llama": LlamaConfig, "resnet": ResNetConfig, "swin": SwinConfig}
# Which dataset kind each family consumes.
FAMILY_KIND = {"llama": "text", "resnet": "image", "swin": "image"}


LLAMA_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "vocab_size",
    "max_seq_len",
)


# More blocks than any model trained here has (the deepest LLaMA has 126 layers): a larger
# count is a typo, and building it (on the meta device, before launch) would never end.
MAX_BLOCKS = 4096


MAX_BASE_WIDTH = 4096  # a ResNet's first stage: wider is a typo (64 is torchvision's)


def _block_count(cfg: ModelConfig) -> tuple[str, object, int] | None:
    """(key, value, blocks) of the setting that decides how many blocks the model has."""
    if isinstance(cfg, LlamaConfig):
        return "model.num_layers", cfg.num_layers, cfg.num_layers
    if isinstance(cfg, ResNetConfig):
        return "model.layers", cfg.layers, sum(cfg.layers)
    if isinstance(cfg, SwinConfig):
        return "model.depths", cfg.depths, sum(cfg.depths)
    return None


def scaled(count: int, cfg: ModelConfig, what: str) -> int:
    """`count` units of one kind (`what`, e.g. "model.num_kv_heads=2 KV groups") times
    model.inner_width: a whole number >= 1, or a ConfigError naming the width."""
    w = cfg.inner_width
    exact = count * w
    whole = round(exact) if math.isfinite(exact) else 0
    if whole < 1 or abs(exact - whole) > 1e-9 * max(1.0, exact):
        raise ConfigError(
            INNER_WIDTH, w, f"gives {count} x {w:g} = {exact:g} {what}, which must be a whole number >= 1"
        )
    return int(whole)


def llama_widths(cfg: LlamaConfig) -> dict:
    """transformers.LlamaConfig's widths of the configured LLaMA, model.inner_width applied
    (head_dim explicit, since num_heads no longer divides hidden_size into it)."""
    if cfg.inner_width == 1:
        return {
            "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
        }
    kv = scaled(cfg.num_kv_heads, cfg, f"KV groups (model.num_kv_heads={cfg.num_kv_heads})")
    ffn = scaled(cfg.intermediate_size, cfg, f"FFN units (model.intermediate_size={cfg.intermediate_size})")
    per_group = cfg.num_heads // cfg.num_kv_heads
    if cfg.hidden_size % (kv * per_group):
        raise ConfigError(
            INNER_WIDTH,
            cfg.inner_width,
            f"gives {kv * per_group} attention heads ({kv} KV groups x {per_group}), which must divide "
            f"model.hidden_size={cfg.hidden_size} (transformers' LlamaConfig requires it); the widths that work "
            f"up to 8: {', '.join(f'{w:g}' for w in llama_inner_widths(cfg))}",
        )
    return {
        "intermediate_size": ffn,
        "num_attention_heads": kv * per_group,
        "num_key_value_heads": kv,
        "head_dim": cfg.hidden_size // cfg.num_heads,
    }


def llama_inner_widths(cfg: LlamaConfig, *, most: float = 8) -> list[float]:
    """The model.inner_width values up to `most` that give the LLaMA whole KV groups and FFN
    units and a head count that divides its hidden size."""
    per_group, out = cfg.num_heads // cfg.num_kv_heads, []
    for groups in range(1, int(most * cfg.num_kv_heads) + 1):
        w = groups / cfg.num_kv_heads
        if cfg.hidden_size % (groups * per_group) == 0 and (cfg.intermediate_size * groups) % cfg.num_kv_heads == 0:
            out.append(w)
    return out


def resnet_stage_widths(cfg: ResNetConfig) -> list[int]:
    """The four stages' widths, model.base_width x (1, 2, 4, 8)."""
    return [cfg.base_width * 2**i for i in range(4)]


def resnet_inner_channels(cfg: ResNetConfig) -> list[int]:
    """Each stage's BasicBlock inner channels, model.inner_width applied."""
    return [scaled(c, cfg, f"inner channels (a BasicBlock of {c})") for c in resnet_stage_widths(cfg)]


def swin_widths(cfg: SwinConfig) -> dict:
    """timm's num_heads, head_dim and mlp_ratio for the configured Swin, model.inner_width applied."""
    if cfg.inner_width == 1:
        return {"num_heads": list(cfg.num_heads), "head_dim": None, "mlp_ratio": cfg.mlp_ratio}
    if min(cfg.num_heads, default=0) < 1:
        raise ConfigError("model.num_heads", cfg.num_heads, "every stage needs >= 1 head")
    dims = [cfg.embed_dim * 2**i for i in range(len(cfg.depths))]
    head_dims = {d // h for d, h in zip(dims, cfg.num_heads, strict=True)}
    if len(head_dims) != 1:
        raise ConfigError(
            INNER_WIDTH,
            cfg.inner_width,
            f"needs one head dimension in every stage (timm's head_dim); "
            f"model.embed_dim={cfg.embed_dim} and model.num_heads={list(cfg.num_heads)} give {sorted(head_dims)}",
        )
    heads = [scaled(h, cfg, f"heads (a stage's model.num_heads={h})") for h in cfg.num_heads]
    # timm's Mlp has int(dim * mlp_ratio) hidden units, with one mlp_ratio for every stage.
    hidden = [scaled(int(d * cfg.mlp_ratio), cfg, f"MLP units (a stage of dimension {d})") for d in dims]
    ratio = hidden[0] / dims[0]
    if [int(d * ratio) for d in dims] != hidden:
        raise ConfigError(
            INNER_WIDTH, cfg.inner_width, f"gives the stages MLPs of {hidden} units, which no single mlp_ratio makes"
        )
    return {"num_heads": heads, "head_dim": head_dims.pop(), "mlp_ratio": ratio}


def validate_model(cfg: ModelConfig) -> None:
    """Shape constraints the upstream constructors would otherwise fail on deep inside."""
    if not cfg.inner_width > 0 or math.isinf(cfg.inner_width):
        raise ConfigError(INNER_WIDTH, cfg.inner_width, "must be a number > 0 (1: the model as configured)")
    count = _block_count(cfg)
    if count is not None and count[2] > MAX_BLOCKS:
        raise ConfigError(count[0], count[1], f"gives {count[2]} blocks, more than the {MAX_BLOCKS} allowed")
    if isinstance(cfg, LlamaConfig):
        for key in LLAMA_SIZES:
            if getattr(cfg, key) < 1:
                raise ConfigError(f"model.{key}", getattr(cfg, key), "must be >= 1")
        if cfg.hidden_size % cfg.num_heads:
            raise ConfigError("model.num_heads", cfg.num_heads, f"must divide model.hidden_size={cfg.hidden_size}")
        if cfg.num_heads % cfg.num_kv_heads:
            raise ConfigError("model.num_kv_heads", cfg.num_kv_heads, f"must divide model.num_heads={cfg.num_heads}")
        if (cfg.hidden_size // cfg.num_heads) % 2:
            raise ConfigError(
                "model.hidden_size",
                cfg.hidden_size,
                f"gives an odd head dimension, hidden_size / num_heads = {cfg.hidden_size // cfg.num_heads}: "
                "rotary position embeddings need an even one",
            )
        if cfg.loss_chunk_tokens < 1:
            raise ConfigError("model.loss_chunk_tokens", cfg.loss_chunk_tokens, "must be >= 1")
    elif isinstance(cfg, ResNetConfig):
        if len(cfg.layers) != 4 or min(cfg.layers) < 1:
            raise ConfigError("model.layers", cfg.layers, "four stages of >= 1 BasicBlock each, e.g. [2, 2, 2, 2]")
        if not 1 <= cfg.base_width <= MAX_BASE_WIDTH:
            raise ConfigError(
                "model.base_width", cfg.base_width, f"must be in [1, {MAX_BASE_WIDTH}] (torchvision's: 64)"
            )
    elif isinstance(cfg, SwinConfig):
        if len(cfg.depths) != len(cfg.num_heads):
            raise ConfigError("model.num_heads", cfg.num_heads, f"one entry per stage of model.depths={cfg.depths}")
        if cfg.img_size % cfg.patch_size:
            raise ConfigError("model.patch_size", cfg.patch_size, f"must divide model.img_size={cfg.img_size}")
    _check_widths(cfg)


def _check_widths(cfg: ModelConfig) -> None:
    """model.inner_width's scaled counts, refused in one line before anything is built."""
    if isinstance(cfg, LlamaConfig):
        llama_widths(cfg)
    elif isinstance(cfg, ResNetConfig):
        resnet_inner_channels(cfg)
    elif isinstance(cfg, SwinConfig):
        swin_widths(cfg)


def vision_builder(cfg: ModelConfig) -> dict:
    """The library, class or name and arguments that build a vision model outside sdp."""
    if isinstance(cfg, ResNetConfig):
        from sdp.models.resnet import resnet_builder

        return resnet_builder(cfg)
    if isinstance(cfg, SwinConfig):
        from sdp.models.swin import swin_builder

        return swin_builder(cfg)
    raise ValueError(f"model family {cfg.family!r} is not a vision model")


def build_model(cfg: ModelConfig) -> nn.Module:
    """Build the plain (unmasked, unwrapped) model on the current default device."""
    if isinstance(cfg, LlamaConfig):
        from sdp.models.llama import build_llama

        return build_llama(cfg)
    if isinstance(cfg, ResNetConfig):
        from sdp.models.resnet import build_resnet

        return build_resnet(cfg)
    if isinstance(cfg, SwinConfig):
        from sdp.models.swin import build_swin

        return build_swin(cfg)
    raise ConfigError("model.family", getattr(cfg, "family", None), f"allowed: {', '.join(FAMILIES)}")


META_KEPT = 8  # the meta models `build_on_meta` keeps, the latest built


def build_on_meta(cfg: ModelConfig) -> nn.Module:
    """The plain model on the meta device (no memory, no initialisation cost), built before any
    process group so that a shape its library refuses ends in one ConfigError, not a traceback
    (transformers, timm and torchvision check more than `validate_model` can know).

    The same config gives the same module, built once (a llama_1b takes 0.1 s, and the planner
    asks for it a few times for each of its structures): read it, never change it."""
    key = repr(cfg)
    if key not in _META:
        _META[key] = _build_on_meta(cfg)
        while len(_META) > META_KEPT:
            del _META[next(iter(_META))]
    return _META[key]


_META: dict[str, nn.Module] = {}


def _build_on_meta(cfg: ModelConfig) -> nn.Module:
    try:
        with torch.device("meta"):
            return build_model(cfg)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever the library raises, reported as one line
        library = (type(err).__module__ or "").split(".")[0] or "the model library"
        reason = " ".join(line.strip() for line in str(err).splitlines() if line.strip())[:400]
        raise ConfigError("model", cfg.name, f"{library} refused its shape: {type(err).__name__}: {reason}") from None


def block_type(family: str) -> type:
    """The module type of the family's blocks: transformers' `LlamaDecoderLayer`, torchvision's
    `BasicBlock`, timm's `SwinTransformerBlock` (imported only for the family asked for). A block
    is what SDP's block-level units, activation checkpointing, compilation and FSDP work on."""
    if family == "llama":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return LlamaDecoderLayer
    if family == "resnet":
        from torchvision.models.resnet import BasicBlock

        return BasicBlock
    if family == "swin":
        from timm.models.swin_transformer import SwinTransformerBlock

        return SwinTransformerBlock
    raise ConfigError("model.family", family, f"allowed: {', '.join(FAMILIES)}")


def blocks(model: nn.Module, *, family: str) -> list[tuple[str, nn.Module]]:
    """The family's blocks present in `model`, by path (a block that forward masking dropped
    has been replaced by a skip module and is not listed)."""
    kind = block_type(family)
    return [(path, m) for path, m in model.named_modules() if isinstance(m, kind)]


def computes_loss(cfg: ModelConfig) -> bool:
    """Whether the model built from `cfg` computes its loss in its forward, given `targets`
    (LLaMA: `sdp.models.llama.LlamaLM`); the others return logits."""
    return isinstance(cfg, LlamaConfig)


def count_params(model: nn.Module) -> int:
    """Number of parameters, counting tied tensors once (works on the meta device)."""
    return sum(p.numel() for p in model.parameters())
