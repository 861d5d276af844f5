"""fashion_mnist: the IDX files of Debian's dataset-fashion-mnist, padded to 3x32x32."""

import gzip
from pathlib import Path

import numpy as np
import torch

from sdp.data.core import (
    DataBundle,
    DataConfig,
    DatasetSpec,
    Placement,
    no_vocab,
    nothing_to_prepare,
    reading,
    require_equal,
)
from sdp.data.images import TensorImages
from sdp.data.loaders import map_style_bundle
from sdp.errors import ConfigError

DEFAULT_PATH = "/usr/share/datasets/fashion-mnist"
FILES = {
    split: (f"{prefix}-images-idx3-ubyte.gz", f"{prefix}-labels-idx1-ubyte.gz")
    for split, prefix in (("train", "train"), ("eval", "t10k"))
}
# IDX magic numbers: two zero bytes, type 0x08 (uint8), number of dimensions.
IMAGES_MAGIC, LABELS_MAGIC = 0x00000803, 0x00000801
# Pixel statistics of the Fashion-MNIST training images.
MEAN, STD = (0.2860,), (0.3530,)
# 28x28 -> 32x32, so CIFAR-sized models run unchanged.
PAD = 2


def data_dir(cfg: DataConfig) -> Path:
    """The directory of the four IDX files."""
    return Path(cfg.path or DEFAULT_PATH).expanduser()


def rebuild_hint(path: Path) -> str:
    """How to get a whole IDX file back: Debian's package for its own files, else the original."""
    if path.parent == Path(DEFAULT_PATH):
        return "reinstall it: apt-get install --reinstall dataset-fashion-mnist"
    return f"replace it with the original, or point dataset.path at Debian's copy in {DEFAULT_PATH}"


def read_idx(path: Path, *, magic: int) -> np.ndarray:
    """Decode a gzipped IDX file of uint8 values, checking its magic number and size; a truncated
    or corrupt file is one DamagedFile naming it and how to get it back."""
    with reading(path, rebuild=rebuild_hint(path)):
        return _decode_idx(path, magic=magic)


def _decode_idx(path: Path, *, magic: int) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        raise ValueError(f"IDX magic {found:#010x}, expected {magic:#010x}")
    ndim = magic & 0xFF
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{data.size} values, header says {shape}")
    return data.reshape(shape)


def load_split(directory: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images [N, 1, 32, 32] (zero-padded) and int64 labels [N] of one split."""
    images_file, labels_file = FILES[split]
    images = read_idx(directory / images_file, magic=IMAGES_MAGIC)
    labels = read_idx(directory / labels_file, magic=LABELS_MAGIC)
    if len(images) != len(labels):
        raise ValueError(f"{directory}: {len(images)} {split} images but {len(labels)} labels")
    padded = np.pad(images, ((0, 0), (PAD, PAD), (PAD, PAD)))[:, None]
    return torch.from_numpy(padded), torch.from_numpy(labels.astype(np.int64))


def validate(cfg: DataConfig, *, offline: bool) -> None:
    """Check the fixed image geometry and that the four IDX files exist."""
    require_equal(cfg, "image_size", expected=32, why="28x28 images padded to 32")
    require_equal(cfg, "num_classes", expected=10, why="Fashion-MNIST has 10 classes")
    directory = data_dir(cfg)
    missing = [name for pair in FILES.values() for name in pair if not (directory / name).is_file()]
    if missing:
        raise ConfigError(
            "dataset.path",
            cfg.path,
            f"missing {', '.join(missing)} in {directory}; run `apt-get install dataset-fashion-mnist` "
            f"(installs them in {DEFAULT_PATH}) or point dataset.path at a directory holding them",
        )


def build(cfg: DataConfig, place: Placement) -> DataBundle:
    """Decode both splits into memory and serve normalised 3x32x32 batches."""
    directory = data_dir(cfg)
    train, evaluation = load_split(directory, "train"), load_split(directory, "eval")
    common = {"mean": MEAN, "std": STD}
    return map_style_bundle(
        cfg,
        train=TensorImages(*train, augment=cfg.augment, aug_seed=place.seed + place.rank, **common),
        evaluation=TensorImages(*evaluation, augment=False, aug_seed=0, **common),
        place=place,
        num_classes=10,
    )


SPEC = DatasetSpec(kind="image", validate=validate, prepare=nothing_to_prepare, build=build, vocab_size=no_vocab)
