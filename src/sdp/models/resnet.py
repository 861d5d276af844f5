"""ResNet through torchvision (BasicBlock stages), with a small-image stem."""

from __future__ import annotations

from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet

from sdp.models import ResNetConfig, resnet_inner_channels, resnet_stage_widths


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
        # Where it is not 64: model.inplanes = base_width, bn1 = BatchNorm2d(base_width), layer1..4 =
        # model._make_layer(BasicBlock, width, blocks, stride) for the stage widths base_width x
        # (1, 2, 4, 8) and strides 1, 2, 2, 2, and fc = Linear(8 * base_width, num_classes).
        "base_width": cfg.base_width,
        "conv1": {
            "in_channels": 3,
            "out_channels": cfg.base_width,
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
    if cfg.base_width != 64:
        rebuild_stages(model, cfg)
    # torchvision's stem is the ImageNet one (7x7/2 + max-pool), which shrinks a
    # 32x32 image to 8x8 before the first block; swap in the configured stem.
    inplanes = cfg.base_width  # the stem feeds the first stage
    model.conv1 = nn.Conv2d(3, inplanes, cfg.stem_kernel, cfg.stem_stride, cfg.stem_kernel // 2, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    if not cfg.stem_pool:
        model.maxpool = nn.Identity()
    if cfg.inner_width != 1:
        narrow_blocks(model, resnet_inner_channels(cfg))
    return model


def rebuild_stages(model: ResNet, cfg: ResNetConfig) -> None:
    """Stages of model.base_width x (1, 2, 4, 8) channels, made by torchvision's own `_make_layer`
    and initialised as torchvision initialises a ResNet (the stem's conv1 is replaced after)."""
    model.inplanes = cfg.base_width
    model.bn1 = nn.BatchNorm2d(cfg.base_width)
    widths = resnet_stage_widths(cfg)
    for i, (width, blocks) in enumerate(zip(widths, cfg.layers, strict=True)):
        setattr(model, f"layer{i + 1}", model._make_layer(BasicBlock, width, blocks, stride=1 if i == 0 else 2))
    model.fc = nn.Linear(widths[-1], cfg.num_classes)
    init_like_torchvision(model)


def init_like_torchvision(module: nn.Module) -> None:
    """What torchvision's ResNet does to its convolutions and norms on construction."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)


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
            for new in (block.conv1, block.bn1, block.conv2):
                init_like_torchvision(new)
