"""Swin Transformer through timm, resized for small images."""

from __future__ import annotations

import timm
from torch import nn

from sdp.models import SwinConfig


def build_swin(cfg: SwinConfig) -> nn.Module:
    # timm clamps the window to the feature map when a late stage is smaller
    # than the window (2x2 at stage 4 for 32x32 inputs with patch 2).
    return timm.create_model(
        "swin_tiny_patch4_window7_224",
        pretrained=False,
        img_size=cfg.img_size,
        patch_size=cfg.patch_size,
        window_size=cfg.window_size,
        embed_dim=cfg.embed_dim,
        depths=tuple(cfg.depths),
        num_heads=tuple(cfg.num_heads),
        mlp_ratio=cfg.mlp_ratio,
        drop_path_rate=cfg.drop_path_rate,
        num_classes=cfg.num_classes,
    )
