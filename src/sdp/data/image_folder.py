"""torchvision's ImageFolder with reproducible augmentation, and ImageNet's transforms
(`sdp.data.imagenet` builds its data from here)."""

from pathlib import Path

import torch
from torchvision import transforms
from torchvision.datasets import ImageFolder

from sdp.data.loaders import augment_seed

__all__ = ["ImageFolder", "SeededImageFolder", "eval_transform", "pairs_to_batch", "train_transform"]

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


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
