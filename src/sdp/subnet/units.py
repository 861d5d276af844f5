"""Unit specs: which slices of which tensors make up each partitionable unit.

A *unit* is the smallest piece of the model a worker holds or drops (SDP,
arXiv 2507.09029): at block level a whole residual branch, at neuron level one
hidden unit of an FFN/MLP, one attention head (one KV group under GQA), or one
inner channel of a ResNet BasicBlock. The residual stream is never sliced.
Everything that belongs to no unit (embeddings, LM head, norms outside the
units, stem, downsampling shortcuts, classifier) is *shared*: held by every
worker and averaged as under DDP.

The spec is read off the plain model's module types (transformers
`LlamaDecoderLayer`, torchvision `BasicBlock`, timm `SwinTransformerBlock`);
the model code is not edited.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import torch
from torch import nn

from sdp.errors import ConfigError
from sdp.models import blocks


class Granularity(StrEnum):
    """masking.granularity: a unit is one hidden unit / head / channel, or a whole block."""

    neuron = "neuron"
    block = "block"


GRANULARITIES = tuple(Granularity)


@dataclass(frozen=True)
class TensorSlice:
    """The part of one parameter or buffer that a group's units own.

    `index[u]` lists the positions along `dim` that belong to unit `u`; with
    `dim=None` the whole tensor belongs to the group's single unit (block level).
    """

    name: str
    dim: int | None
    index: torch.Tensor | None
    is_buffer: bool = False

    def unit_positions(self, units: torch.Tensor) -> torch.Tensor:
        """Positions along `dim` of the given units, in unit order (flattened)."""
        return self.index[units].reshape(-1)


@dataclass
class UnitGroup:
    """Interchangeable units at one site of the model (e.g. the FFN units of layer 3)."""

    name: str  # module path of the site
    kind: str  # ffn | heads | channels | block
    num_units: int
    slices: list[TensorSlice]
    # The affine modules (Linear, Conv2d, BatchNorm) whose outputs are the site's
    # contribution to the residual stream. Forward masking rescales these outputs
    # (see MaskingConfig.scale); being affine, a scale can also be folded into
    # their weight and bias.
    outputs: list[str] = field(default_factory=list)
    # Integer module attributes that must equal the number of units a rank
    # holds after slicing (timm's WindowAttention.num_heads).
    count_attrs: list[str] = field(default_factory=list)
    # Block level only: builds the module that replaces a dropped block under
    # forward masking (the residual path, e.g. identity or the shortcut).
    skip: Callable[[nn.Module], nn.Module] | None = None

    def unit_numel(self, shapes: dict[str, torch.Size]) -> int:
        """Elements of one unit over its tensors named in `shapes` (units in a group are the same size)."""
        total = 0
        for s in self.slices:
            if s.name not in shapes:
                continue
            shape = shapes[s.name]
            if s.dim is None:
                total += shape.numel()
            else:
                total += shape.numel() // shape[s.dim] * s.index.shape[1]
        return total


@dataclass
class UnitSpec:
    """All unit groups of a model, and the names of its shared parameters."""

    granularity: str
    groups: list[UnitGroup]
    shared_params: list[str]
    shared_buffers: list[str] = field(default_factory=list)

    def unit_tensor_names(self) -> set[str]:
        return {s.name for g in self.groups for s in g.slices}


def _runs(n_units: int, width: int) -> torch.Tensor:
    """Index of `n_units` contiguous runs of `width` positions: unit u owns [u*width, (u+1)*width)."""
    return torch.arange(n_units * width).view(n_units, width)


def _sl(prefix: str, name: str, dim: int | None, index: torch.Tensor | None, *, buffer: bool = False) -> TensorSlice:
    return TensorSlice(f"{prefix}.{name}" if prefix else name, dim, index, buffer)


def _block_group(path: str, block: nn.Module, rule: FamilyRule) -> UnitGroup:
    """A block unit: every parameter and float buffer of the block's residual-branch submodules."""
    slices = []
    for sub in rule.branch:
        module = block.get_submodule(sub)
        slices += [_sl(f"{path}.{sub}", name, None, None) for name, _ in module.named_parameters()]
        slices += [
            _sl(f"{path}.{sub}", name, None, None, buffer=True)
            for name, buf in module.named_buffers()
            if buf is not None and buf.is_floating_point()
        ]
    outputs = [f"{path}.{o}" for o in rule.outputs]
    return UnitGroup(name=path, kind="block", num_units=1, slices=slices, outputs=outputs, skip=rule.skip)


def _ffn_group(path: str, *, rows: list[str], cols: list[str], n: int) -> UnitGroup:
    """Hidden units of a two-layer MLP: `rows` of the input projections, `cols` of the output one."""
    unit = _runs(n, 1)
    slices = [_sl(path, name, 0, unit) for name in rows] + [_sl(path, name, 1, unit) for name in cols]
    out_proj = cols[0].rsplit(".", 1)[0]
    return UnitGroup(path, "ffn", n, slices, outputs=[f"{path}.{out_proj}"])


# ---------------------------------------------------------------- LLaMA (transformers)


class _SkippedDecoderLayer(nn.Module):
    """A dropped decoder layer: the hidden states pass through the residual path unchanged."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def _llama_neurons(path: str, layer: nn.Module) -> list[UnitGroup]:
    """FFN hidden units, and heads: one unit per KV head with the query heads that read it (GQA)."""
    mlp, attn = f"{path}.mlp", f"{path}.self_attn"
    ffn = _ffn_group(
        mlp, rows=["gate_proj.weight", "up_proj.weight"], cols=["down_proj.weight"], n=layer.mlp.gate_proj.out_features
    )
    head_dim = layer.self_attn.head_dim
    kv = layer.self_attn.k_proj.out_features // head_dim
    q_rows, kv_rows = _runs(kv, layer.self_attn.num_key_value_groups * head_dim), _runs(kv, head_dim)
    slices = [
        _sl(attn, "q_proj.weight", 0, q_rows),
        _sl(attn, "k_proj.weight", 0, kv_rows),
        _sl(attn, "v_proj.weight", 0, kv_rows),
        _sl(attn, "o_proj.weight", 1, q_rows),
    ]
    for proj, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
        if getattr(layer.self_attn, proj).bias is not None:
            slices.append(_sl(attn, f"{proj}.bias", 0, rows))
    return [ffn, UnitGroup(attn, "heads", kv, slices, outputs=[f"{attn}.o_proj"])]


# ---------------------------------------------------------------- ResNet (torchvision)


class _SkippedBasicBlock(nn.Module):
    """A dropped BasicBlock: relu(shortcut(x)), the block without its residual branch.

    As in stochastic depth (Huang et al. 2016), a block that changes shape keeps
    its projection shortcut, which is shared; for the others relu(x) = x, since
    a block's input is already a ReLU output.
    """

    def __init__(self, block: nn.Module):
        super().__init__()
        self.downsample = block.downsample

    def forward(self, x):
        return torch.relu(self.downsample(x)) if self.downsample is not None else x


def _resnet_neurons(path: str, block: nn.Module) -> list[UnitGroup]:
    """Inner channels of a BasicBlock: conv1's outputs = bn1 (with its statistics) = conv2's inputs."""
    n = block.conv1.out_channels
    ch = _runs(n, 1)
    slices = [
        _sl(path, "conv1.weight", 0, ch),
        _sl(path, "bn1.weight", 0, ch),
        _sl(path, "bn1.bias", 0, ch),
        _sl(path, "bn1.running_mean", 0, ch, buffer=True),
        _sl(path, "bn1.running_var", 0, ch, buffer=True),
        _sl(path, "conv2.weight", 1, ch),
    ]
    return [UnitGroup(path, "channels", n, slices, outputs=[f"{path}.conv2"])]


# ---------------------------------------------------------------- Swin (timm)


def _swin_neurons(path: str, block: nn.Module) -> list[UnitGroup]:
    """MLP hidden units and attention heads of a Swin block."""
    mlp, attn = f"{path}.mlp", f"{path}.attn"
    ffn = _ffn_group(mlp, rows=["fc1.weight", "fc1.bias"], cols=["fc2.weight"], n=block.mlp.fc1.out_features)
    heads = block.attn.num_heads
    attn_dim = block.attn.proj.in_features
    head_dim = attn_dim // heads
    # qkv rows are laid out [q | k | v], each split by head: head h owns one run in each third.
    qkv = torch.stack([_runs(heads, head_dim) + part * attn_dim for part in range(3)], dim=1).view(heads, -1)
    slices = [
        _sl(attn, "qkv.weight", 0, qkv),
        _sl(attn, "proj.weight", 1, _runs(heads, head_dim)),
        _sl(attn, "relative_position_bias_table", 1, _runs(heads, 1)),
    ]
    if block.attn.qkv.bias is not None:
        slices.append(_sl(attn, "qkv.bias", 0, qkv))
    heads_group = UnitGroup(attn, "heads", heads, slices, outputs=[f"{attn}.proj"], count_attrs=[f"{attn}.num_heads"])
    return [ffn, heads_group]


# ---------------------------------------------------------------- one mechanism for every family


@dataclass(frozen=True)
class FamilyRule:
    """Where a family's units are (its blocks are `sdp.models.blocks`): the block's residual
    branch and the modules whose outputs join the residual stream, how a dropped block is
    skipped, and the neuron-level groups inside a block."""

    branch: list[str]
    outputs: list[str]
    skip: Callable[[nn.Module], nn.Module]
    neurons: Callable[[str, nn.Module], list[UnitGroup]]


RULES = {
    "llama": FamilyRule(
        branch=["input_layernorm", "self_attn", "post_attention_layernorm", "mlp"],
        outputs=["self_attn.o_proj", "mlp.down_proj"],
        skip=lambda _: _SkippedDecoderLayer(),
        neurons=_llama_neurons,
    ),
    "resnet": FamilyRule(
        branch=["conv1", "bn1", "conv2", "bn2"],
        outputs=["bn2"],
        skip=_SkippedBasicBlock,
        neurons=_resnet_neurons,
    ),
    "swin": FamilyRule(
        branch=["norm1", "attn", "norm2", "mlp"],
        outputs=["attn.proj", "mlp.fc2"],
        skip=lambda _: nn.Identity(),
        neurons=_swin_neurons,
    ),
}


def unit_spec(model: nn.Module, *, family: str, granularity: str) -> UnitSpec:
    """The unit spec of a plain model of `family` at `granularity` (neuron | block)."""
    if granularity not in GRANULARITIES:
        raise ConfigError("masking.granularity", granularity, f"allowed: {', '.join(GRANULARITIES)}")
    rule = RULES[family]
    groups = []
    for path, block in blocks(model, family=family):
        groups += [_block_group(path, block, rule)] if granularity == "block" else rule.neurons(path, block)
    if not groups:
        raise ValueError(f"found no {granularity} units in {type(model).__name__}")
    owned = {s.name for g in groups for s in g.slices}
    shared_params = [n for n, _ in model.named_parameters() if n not in owned]
    shared_buffers = [n for n, b in model.named_buffers() if n not in owned and b is not None]
    return UnitSpec(granularity, groups, shared_params, shared_buffers)
