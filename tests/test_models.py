"""Model configs build the stated architectures (on the meta device: no memory)."""

import pytest
import torch

from sdp.errors import ConfigError
from sdp.models import build_model, build_on_meta, count_params
from sdp.run.config import typed_config

# (model option, dataset option, stated parameters: exact)
STATED = [
    ("llama_134m", "synthetic_text", 134_105_856),
    ("llama_500m", "synthetic_text", 522_384_640),
    ("llama_1b", "synthetic_text", 1_339_082_752),
    ("resnet18", "cifar10", 11_173_962),  # the CIFAR ResNet-18 at 10 classes
    ("swin_t", "cifar10", 27_505_108),
]


@pytest.mark.parametrize("model,dataset,expected", STATED)
def test_parameter_counts_match_stated_sizes(model, dataset, expected):
    cfg = typed_config([f"model={model}", f"dataset={dataset}"])
    with torch.device("meta"):
        n = count_params(build_model(cfg.model))
    assert n == expected


def test_llama_shapes_follow_config():
    cfg = typed_config(["model=llama_tiny", "dataset=synthetic_text"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    layer = model.model.layers[0]
    assert layer.mlp.gate_proj.weight.shape == (cfg.model.intermediate_size, cfg.model.hidden_size)
    head_dim = cfg.model.hidden_size // cfg.model.num_heads
    assert layer.self_attn.k_proj.weight.shape == (cfg.model.num_kv_heads * head_dim, cfg.model.hidden_size)
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied, as configured


def test_cifar_resnet_keeps_resolution():
    cfg = typed_config(["model=resnet18", "dataset=cifar10"])
    model = build_model(cfg.model)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)
    out = model.layer1(model.conv1(torch.zeros(1, 3, 32, 32)))
    assert out.shape[-2:] == (32, 32)


def test_swin_runs_at_32px():
    cfg = typed_config(["model=swin_tiny", "dataset=cifar100"])
    model = build_model(cfg.model)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 100)


def test_a_shape_the_library_refuses_is_one_config_error_naming_the_model(monkeypatch):
    import sdp.models

    cfg = typed_config(["model=swin_tiny", "dataset=synthetic_image"]).model
    assert build_on_meta(cfg).patch_embed.proj.weight.is_meta
    assert build_on_meta(cfg) is build_on_meta(cfg)  # built once for one config
    monkeypatch.setattr(sdp.models, "_META", {})  # a config not built yet

    class UpstreamError(ValueError):
        __module__ = "timm.layers"

    def refuse(_cfg):
        raise UpstreamError("window_size 7 does not divide\n   the feature map 8")

    monkeypatch.setattr(sdp.models, "build_model", refuse)
    with pytest.raises(ConfigError) as info:
        build_on_meta(cfg)
    assert str(info.value) == (
        "model='swin_tiny': timm refused its shape: UpstreamError: window_size 7 does not divide the feature map 8"
    )
