"""imagenet: torchvision ImageFolder trees at path/train and path/val."""

from pathlib import Path

import torch
from torchvision import transforms
from torchvision.datasets import ImageFolder

from sdp.data.core import DataBundle, DataConfig, DatasetSpec, Placement, no_vocab, nothing_to_prepare, require_at_least
from sdp.data.loaders import augment_seed, map_style_bundle
from sdp.errors import ConfigError

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SPLIT_DIRS = ("train", "val")


class SeededImageFolder(ImageFolder):
    """ImageFolder whose random transforms draw from a seed keyed by (seed + rank, epoch, index).

    torchvision's transforms use torch's global RNG; forking it per sample keeps
    the draws reproducible and independent of the trainer's RNG and of num_workers.
    """

    def __init__(self, root: Path, *, transform: transforms.Compose, aug_seed: int):
        super().__init__(str(root), transform=transform)
        self.aug_seed, self.epoch = aug_seed, 0

    def set_epoch(self, epoch: int) -> None:
        """Select the augmentation draws of `epoch`."""
        self.epoch = epoch

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(augment_seed(aug_seed=self.aug_seed, epoch=self.epoch, key=index))
            return super().__getitem__(index)


def pairs_to_batch(samples: list[tuple[torch.Tensor, int]]) -> dict:
    """collate_fn: (image, label) pairs -> {"inputs": [B, 3, H, W], "targets": [B]}."""
    images, labels = zip(*samples, strict=True)
    return {"inputs": torch.stack(images), "targets": torch.tensor(labels, dtype=torch.int64)}


def train_transform(size: int) -> transforms.Compose:
    """RandomResizedCrop(size) + horizontal flip, normalised."""
    return transforms.Compose(
        [
            transforms.RandomResizedCrop(size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(MEAN, STD),
        ]
    )


def eval_transform(size: int) -> transforms.Compose:
    """Resize to 256/224 of size, then CenterCrop(size), normalised."""
    return transforms.Compose(
        [
            transforms.Resize(round(size * 256 / 224)),
            transforms.CenterCrop(size),
            transforms.ToTensor(),
            transforms.Normalize(MEAN, STD),
        ]
    )


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
    root = Path(cfg.path).expanduser()
    aug = train_transform(cfg.image_size) if cfg.augment else eval_transform(cfg.image_size)
    train = SeededImageFolder(root / "train", transform=aug, aug_seed=place.seed + place.rank)
    evaluation = ImageFolder(str(root / "val"), transform=eval_transform(cfg.image_size))
    _check_classes(cfg, train, evaluation)
    return map_style_bundle(
        cfg, train=train, evaluation=evaluation, place=place, num_classes=cfg.num_classes, collate_fn=pairs_to_batch
    )


SPEC = DatasetSpec(kind="image", validate=validate, prepare=nothing_to_prepare, build=build, vocab_size=no_vocab)
