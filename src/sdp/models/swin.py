"""Swin Transformer through timm, resized for small images."""

from __future__ import annotations

import timm
from torch import nn

from sdp.models import SwinConfig, swin_widths

TIMM_NAME = "swin_tiny_patch4_window7_224"


def swin_kwargs(cfg: SwinConfig) -> dict:
    """timm.create_model's keyword arguments for the configured Swin (with TIMM_NAME)."""
    return {
        "pretrained": False,
        "img_size": cfg.img_size,
        "patch_size": cfg.patch_size,
        "window_size": cfg.window_size,
        "embed_dim": cfg.embed_dim,
        "depths": list(cfg.depths),
        **swin_widths(cfg),
        "drop_path_rate": cfg.drop_path_rate,
        "num_classes": cfg.num_classes,
    }


def swin_builder(cfg: SwinConfig) -> dict:
    """How to build the configured Swin from timm alone (written next to an exported model)."""
    return {"library": "timm", "name": TIMM_NAME, "kwargs": swin_kwargs(cfg)}


def build_swin(cfg: SwinConfig) -> nn.Module:
    # timm clamps the window to the feature map when a late stage is smaller
    # than the window (2x2 at stage 4 for 32x32 inputs with patch 2).
    kwargs = swin_kwargs(cfg)
    kwargs.update(depths=tuple(kwargs["depths"]), num_heads=tuple(kwargs["num_heads"]))
    return timm.create_model(TIMM_NAME, **kwargs)
