"""cifar10 / cifar100: torchvision's readers of the python-pickle batches, served from memory."""

import functools
import os
import pickle
from pathlib import Path
from typing import NamedTuple

import torch

from sdp.data.core import DataBundle, DataConfig, DatasetSpec, Placement, no_vocab, reading, require_equal
from sdp.data.images import TensorImages
from sdp.data.loaders import map_style_bundle
from sdp.errors import ConfigError


def _batch_files(reader: type) -> list[str]:
    """Names of the files a CIFAR reader opens, inside its base_folder."""
    return [name for name, _ in reader.train_list + reader.test_list] + [reader.meta["filename"]]


class _FilesPresent:
    """Mixin: accept the batch files when they exist instead of when their md5 matches.

    torchvision checks every batch file against the md5 of the official release,
    which small fixtures written in the same format cannot match. download()
    still verifies the md5 of the archive it fetches.
    """

    def _check_integrity(self) -> bool:
        return all(os.path.isfile(os.path.join(self.root, self.base_folder, n)) for n in _batch_files(type(self)))

    def _load_meta(self) -> None:
        with open(os.path.join(self.root, self.base_folder, self.meta["filename"]), "rb") as f:
            self.classes = pickle.load(f, encoding="latin1")[self.meta["key"]]
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}


@functools.cache
def present_reader(name: str) -> type:
    """torchvision's reader `name` (CIFAR10, CIFAR100), requiring only that its files exist.

    torchvision is imported here, by CIFAR runs alone: it takes about a second and brings
    torch._dynamo with it, which no other dataset needs."""
    from torchvision import datasets

    base = getattr(datasets, name)
    return type(f"Present{name}", (_FilesPresent, base), {"__doc__": f"{name} that only requires its files to exist."})


class Variant(NamedTuple):
    reader_name: str  # the torchvision.datasets class
    title: str
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def reader(self) -> type:
        return present_reader(self.reader_name)


VARIANTS = {
    "cifar10": Variant("CIFAR10", "CIFAR-10", 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": Variant("CIFAR100", "CIFAR-100", 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


def _missing_files(cfg: DataConfig, variant: Variant) -> list[str]:
    folder = Path(cfg.path).expanduser() / variant.reader.base_folder
    return [name for name in _batch_files(variant.reader) if not (folder / name).is_file()]


def validate(cfg: DataConfig, *, offline: bool) -> None:
    """Check the geometry and that the batch files exist (or will be downloaded)."""
    variant = VARIANTS[cfg.name]
    require_equal(cfg, "image_size", expected=32, why=f"{variant.title} images are 32x32")
    require_equal(
        cfg, "num_classes", expected=variant.num_classes, why=f"{variant.title} has {variant.num_classes} classes"
    )
    if not cfg.path:
        raise ConfigError("dataset.path", cfg.path, f"set it to the directory holding {variant.reader.base_folder}")
    missing = _missing_files(cfg, variant)
    if missing and not cfg.download:
        raise ConfigError(
            "dataset.path",
            cfg.path,
            f"{variant.reader.base_folder}/ lacks {', '.join(missing)}; set dataset.download=true, "
            f"or point dataset.path at the directory holding {variant.reader.base_folder}",
        )


def prepare(cfg: DataConfig) -> None:
    """Download and extract the archive when download is set and files are missing."""
    variant = VARIANTS[cfg.name]
    if cfg.download and _missing_files(cfg, variant):
        variant.reader(Path(cfg.path).expanduser(), train=False, download=True)


def _load(cfg: DataConfig, variant: Variant, *, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images [N, 3, 32, 32] and int64 labels [N] of one split; a batch file that cannot be
    read is one DamagedFile naming it, and how to get it back."""
    folder = Path(cfg.path).expanduser() / variant.reader.base_folder
    try:
        reader = variant.reader(Path(cfg.path).expanduser(), train=train)
    except Exception:  # noqa: BLE001 - the reader does not say which file: find it
        _raise_damaged(folder, variant)
        raise
    images = torch.from_numpy(reader.data).permute(0, 3, 1, 2).contiguous()
    return images, torch.tensor(reader.targets, dtype=torch.int64)


def _raise_damaged(folder: Path, variant: Variant) -> None:
    """DamagedFile for the first of the folder's batch files that does not unpickle."""
    rebuild = f"delete {folder} and run with dataset.download=true, or restore it from the archive"
    for name in _batch_files(variant.reader):
        with reading(folder / name, rebuild=rebuild), open(folder / name, "rb") as f:
            pickle.load(f, encoding="latin1")


def build(cfg: DataConfig, place: Placement) -> DataBundle:
    """Read both splits into memory; train batches get RandomCrop(32, 4) + flip."""
    variant = VARIANTS[cfg.name]
    common = {"mean": variant.mean, "std": variant.std}
    return map_style_bundle(
        cfg,
        train=TensorImages(
            *_load(cfg, variant, train=True), augment=cfg.augment, aug_seed=place.seed + place.rank, **common
        ),
        evaluation=TensorImages(*_load(cfg, variant, train=False), augment=False, aug_seed=0, **common),
        place=place,
        num_classes=variant.num_classes,
    )


SPEC = DatasetSpec(kind="image", validate=validate, prepare=prepare, build=build, vocab_size=no_vocab)
