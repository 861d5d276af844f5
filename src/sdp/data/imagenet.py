"""imagenet: torchvision ImageFolder trees at path/train and path/val.

Checking a config needs no torchvision; building the data imports it (`sdp.data.image_folder`),
so only ImageNet runs pay for it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sdp.data.core import DataBundle, DataConfig, DatasetSpec, Placement, no_vocab, nothing_to_prepare, require_at_least
from sdp.data.loaders import map_style_bundle
from sdp.errors import ConfigError

if TYPE_CHECKING:
    from torchvision.datasets import ImageFolder

SPLIT_DIRS = ("train", "val")


def validate(cfg: DataConfig, *, offline: bool) -> None:
    """Check the sizes and that path/train and path/val exist."""
    require_at_least(cfg, "image_size", "num_classes", minimum=1)
    if not cfg.path:
        raise ConfigError("dataset.path", cfg.path, "set it to an ImageNet root holding train/ and val/")
    missing = [name for name in SPLIT_DIRS if not (Path(cfg.path).expanduser() / name).is_dir()]
    if missing:
        raise ConfigError(
            "dataset.path",
            cfg.path,
            f"lacks {'/, '.join(missing)}/; point it at an ImageNet root holding train/<class>/ and val/<class>/",
        )


def _check_classes(cfg: DataConfig, train: ImageFolder, evaluation: ImageFolder) -> None:
    """ImageFolder numbers classes by sorted folder name, so both splits need the same folders."""
    if len(train.classes) != cfg.num_classes:
        raise ConfigError(
            "dataset.num_classes",
            cfg.num_classes,
            f"must match the {len(train.classes)} class folders of {cfg.path}/train",
        )
    if evaluation.classes != train.classes:
        raise ConfigError("dataset.path", cfg.path, "val/ must hold the same class folders as train/")


def build(cfg: DataConfig, place: Placement) -> DataBundle:
    """Scan both trees; decode and transform images per sample with PIL."""
    from sdp.data.image_folder import ImageFolder, SeededImageFolder, eval_transform, pairs_to_batch, train_transform

    root = Path(cfg.path).expanduser()
    aug = train_transform(cfg.image_size) if cfg.augment else eval_transform(cfg.image_size)
    train = SeededImageFolder(root / "train", transform=aug, aug_seed=place.seed + place.rank)
    evaluation = ImageFolder(str(root / "val"), transform=eval_transform(cfg.image_size))
    _check_classes(cfg, train, evaluation)
    return map_style_bundle(
        cfg, train=train, evaluation=evaluation, place=place, num_classes=cfg.num_classes, collate_fn=pairs_to_batch
    )


SPEC = DatasetSpec(kind="image", validate=validate, prepare=nothing_to_prepare, build=build, vocab_size=no_vocab)
