"""In-memory image datasets whose batches are augmented and normalised as whole tensors.

Per-sample PIL transforms cost more than the model on small images; indexing a
uint8 tensor and drawing every sample's crop and flip in one gather is fast.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from sdp.data.loaders import EpochDataset, augment_generator


def random_crop_flip(images: torch.Tensor, *, padding: int, generator: torch.Generator) -> torch.Tensor:
    """Per sample: RandomCrop(size, padding) with zero fill, then RandomHorizontalFlip.

    images: [B, C, H, W]; each sample gets its own offsets and flip, applied with
    a single advanced-indexing gather from the zero-padded batch.
    """
    b, c, h, w = images.shape
    padded = F.pad(images, (padding,) * 4)
    top = torch.randint(0, 2 * padding + 1, (b, 1), generator=generator)
    left = torch.randint(0, 2 * padding + 1, (b, 1), generator=generator)
    rows = top + torch.arange(h)
    cols = left + torch.arange(w)
    flip = torch.rand(b, 1, generator=generator) < 0.5
    cols = torch.where(flip, cols.flip(1), cols)
    return padded[
        torch.arange(b)[:, None, None, None],
        torch.arange(c)[None, :, None, None],
        rows[:, None, :, None],
        cols[:, None, None, :],
    ]


def normalize(images: torch.Tensor, *, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 [B, C, H, W] -> float32 (x / 255 - mean) / std, grey images repeated to 3 channels."""
    mean_t = torch.tensor(mean).view(1, -1, 1, 1)
    std_t = torch.tensor(std).view(1, -1, 1, 1)
    out = images.float().div_(255).sub_(mean_t).div_(std_t)
    return out.repeat(1, 3, 1, 1) if out.shape[1] == 1 else out


class TensorImages(EpochDataset):
    """uint8 images [N, C, H, W] and int64 labels [N], held in memory."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        *,
        mean: Sequence[float],
        std: Sequence[float],
        augment: bool,
        aug_seed: int,
        padding: int = 4,
    ):
        self.images, self.labels = images, labels.long()
        self.mean, self.std = mean, std
        self.augment, self.aug_seed, self.padding = augment, aug_seed, padding

    def __len__(self) -> int:
        return len(self.labels)

    def __getitems__(self, indices: list[int]) -> dict:
        index = torch.as_tensor(indices)
        images = self.images[index]
        if self.augment:
            generator = augment_generator(aug_seed=self.aug_seed, epoch=self.epoch, key=indices[0])
            images = random_crop_flip(images, padding=self.padding, generator=generator)
        return {"inputs": normalize(images, mean=self.mean, std=self.std), "targets": self.labels[index]}
