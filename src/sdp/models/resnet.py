"""ResNet through torchvision (BasicBlock stages), with a small-image stem."""

from __future__ import annotations

from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet

from sdp.models import ResNetConfig


def resnet_builder(cfg: ResNetConfig) -> dict:
    """How to build the configured ResNet from torchvision alone (written next to an exported
    model): ResNet(BasicBlock, layers, num_classes), then conv1 replaced by the stem below and,
    without stem_pool, maxpool by nn.Identity()."""
    return {
        "library": "torchvision",
        "class": "torchvision.models.resnet.ResNet",
        "block": "torchvision.models.resnet.BasicBlock",
        "layers": list(cfg.layers),
        "num_classes": cfg.num_classes,
        "conv1": {
            "in_channels": 3,
            "out_channels": 64,
            "kernel_size": cfg.stem_kernel,
            "stride": cfg.stem_stride,
            "padding": cfg.stem_kernel // 2,
            "bias": False,
        },
        "maxpool": "torchvision" if cfg.stem_pool else "identity",
    }


def build_resnet(cfg: ResNetConfig) -> ResNet:
    model = ResNet(BasicBlock, list(cfg.layers), num_classes=cfg.num_classes)
    # torchvision's stem is the ImageNet one (7x7/2 + max-pool), which shrinks a
    # 32x32 image to 8x8 before the first block; swap in the configured stem.
    inplanes = model.conv1.out_channels
    model.conv1 = nn.Conv2d(3, inplanes, cfg.stem_kernel, cfg.stem_stride, cfg.stem_kernel // 2, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    if not cfg.stem_pool:
        model.maxpool = nn.Identity()
    return model
