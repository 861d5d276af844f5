"""ResNet through torchvision (BasicBlock stages), with a small-image stem."""

from __future__ import annotations

from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet

from sdp.models import ResNetConfig, resnet_inner_channels


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
        # Each stage's BasicBlock inner channels c (model.inner_width); where c differs from the
        # stage's width, every block of the stage has conv1 = Conv2d(in, c, 3, stride, 1,
        # bias=False), bn1 = BatchNorm2d(c) and conv2 = Conv2d(c, width, 3, 1, 1, bias=False).
        "inner_channels": resnet_inner_channels(cfg),
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
    if cfg.inner_width != 1:
        narrow_blocks(model, resnet_inner_channels(cfg))
    return model


def narrow_blocks(model: ResNet, inner: list[int]) -> None:
    """Give every BasicBlock of stage i `inner[i]` inner channels (conv1's outputs, bn1, conv2's
    inputs), initialised as torchvision initialises a ResNet's convolutions and norms."""
    stages = (model.layer1, model.layer2, model.layer3, model.layer4)
    for stage, channels in zip(stages, inner, strict=True):
        for block in stage:
            c1 = block.conv1
            block.conv1 = nn.Conv2d(c1.in_channels, channels, 3, c1.stride, 1, bias=False)
            block.bn1 = nn.BatchNorm2d(channels)
            block.conv2 = nn.Conv2d(channels, block.conv2.out_channels, 3, 1, 1, bias=False)
            for conv in (block.conv1, block.conv2):
                nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
