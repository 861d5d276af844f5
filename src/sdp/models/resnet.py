"""ResNet through torchvision (BasicBlock stages), with a small-image stem."""

from __future__ import annotations

from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet

from sdp.models import ResNetConfig


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
