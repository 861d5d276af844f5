"""synthetic_text / synthetic_image: deterministic random data for unit tests.

The data depends only on the config (a fixed generator seed), never on the rank
or the training seed, so every rank shards the same samples.
"""

import numpy as np
import torch

from sdp.data.core import DataBundle, DataConfig, DatasetSpec, Placement, no_vocab, nothing_to_prepare, require_at_least
from sdp.data.images import TensorImages
from sdp.data.loaders import map_style_bundle
from sdp.data.packing import token_bundle

DATA_SEED = 0
# Uniform random pixels: mean 0.5, std 1/sqrt(12).
PIXEL_MEAN, PIXEL_STD = (0.5,) * 3, (0.2887,) * 3


def validate_text(cfg: DataConfig, *, offline: bool) -> None:
    """Check the sizes of the synthetic token data."""
    require_at_least(cfg, "seq_len", "vocab_size", "num_samples", "num_eval_samples", minimum=1)


def build_text(cfg: DataConfig, place: Placement) -> DataBundle:
    """num_samples train rows and num_eval_samples eval rows of random tokens."""
    rng = np.random.default_rng(DATA_SEED)
    train, evaluation = (
        rng.integers(0, cfg.vocab_size, size=n * (cfg.seq_len + 1)) for n in (cfg.num_samples, cfg.num_eval_samples)
    )
    return token_bundle(cfg, train, evaluation, place, corpus=False)


def validate_image(cfg: DataConfig, *, offline: bool) -> None:
    """Check the sizes of the synthetic images."""
    require_at_least(cfg, "image_size", "num_classes", "num_samples", "num_eval_samples", minimum=1)


def _random_images(rng: np.random.Generator, cfg: DataConfig, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    images = rng.integers(0, 256, size=(count, 3, cfg.image_size, cfg.image_size), dtype=np.uint8)
    labels = rng.integers(0, cfg.num_classes, size=count)
    return torch.from_numpy(images), torch.from_numpy(labels)


def build_image(cfg: DataConfig, place: Placement) -> DataBundle:
    """num_samples train and num_eval_samples eval random images with random labels."""
    rng = np.random.default_rng(DATA_SEED)
    splits = [_random_images(rng, cfg, n) for n in (cfg.num_samples, cfg.num_eval_samples)]
    common = {"mean": PIXEL_MEAN, "std": PIXEL_STD}
    return map_style_bundle(
        cfg,
        train=TensorImages(*splits[0], augment=cfg.augment, aug_seed=place.seed + place.rank, **common),
        evaluation=TensorImages(*splits[1], augment=False, aug_seed=0, **common),
        place=place,
        num_classes=cfg.num_classes,
    )


def text_vocab_size(cfg: DataConfig) -> int:
    """Random tokens are drawn from [0, vocab_size)."""
    return cfg.vocab_size


TEXT_SPEC = DatasetSpec(
    kind="text", validate=validate_text, prepare=nothing_to_prepare, build=build_text, vocab_size=text_vocab_size
)
IMAGE_SPEC = DatasetSpec(
    kind="image", validate=validate_image, prepare=nothing_to_prepare, build=build_image, vocab_size=no_vocab
)
