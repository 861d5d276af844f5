"""The data layer's shared types: the config, the bundle handed to the trainer, and
the per-dataset hooks that `sdp.data.api` dispatches to."""

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from sdp.errors import ConfigError
from sdp.paths import DamagedFile, describe

KINDS = ("text", "image")


@dataclass
class DataConfig:
    """One dataset's settings; the Hydra group `conf/dataset/` fills it.

    Only `name` and `kind` are required; each dataset reads the fields it needs
    and ignores the rest.
    """

    name: str
    kind: str
    # A directory, a hub dataset id (fineweb), or None for the dataset's own default.
    path: str | None = None
    # --- text ---
    seq_len: int = 256
    # Token ids the text pipeline emits are < vocab_size: the size local_text trains its
    # tokenizer to, the cap on a pretrained tokenizer's ids (0 = no cap), the synthetic range.
    vocab_size: int = 4096
    # Hub id, tokenizer.json file, or directory holding tokenizer.json.
    tokenizer: str | None = None
    # None: the first of the usual EOS spellings the tokenizer knows.
    eos_token: str | None = None
    hub_config: str | None = None
    hub_split: str = "train"
    text_column: str = "text"
    eval_docs: int = 1000
    shuffle_buffer: int = 10000
    text_glob: str = "**/*.py"
    # Path components that drop a file from local_text (a pyenv stdlib dir holds site-packages).
    exclude: list[str] = field(default_factory=lambda: ["site-packages"])
    eval_every: int = 20
    max_files: int = 0
    max_bytes: int = 64_000_000
    # --- image ---
    image_size: int = 32
    num_classes: int = 10
    augment: bool = True
    download: bool = False
    # --- synthetic ---
    num_samples: int = 512
    num_eval_samples: int = 128
    # --- loading ---
    num_workers: int = 0
    eval_batches: int = 0
    # None: $SDP_CACHE_DIR, else ~/.cache/sdp (see cache_root).
    cache_dir: str | None = None


@dataclass
class DataBundle:
    """What `build_data` hands the trainer for one rank."""

    kind: str
    train: Iterator[dict]
    make_eval: Callable[[], Iterable[dict]]
    num_classes: int | None
    vocab_size: int | None


class Placement(NamedTuple):
    """Where build_data runs: this rank, the world, per-rank batch sizes and the seed."""

    rank: int
    world_size: int
    batch_size: int
    eval_batch_size: int
    seed: int
    start_batch: int = 0  # train batches this rank's stream already yielded (a resumed run's)


def no_tokenizer(cfg: DataConfig) -> None:
    """`tokenizer_file` hook of datasets without one (images, synthetic ids)."""
    return None


class DatasetSpec(NamedTuple):
    """The hooks one dataset provides; `sdp.data.api` picks them by `DataConfig.name`."""

    kind: str
    validate: Callable[..., None]
    prepare: Callable[[DataConfig], None]
    build: Callable[[DataConfig, Placement], DataBundle]
    vocab_size: Callable[[DataConfig], int | None]
    # The tokenizer.json the run's text was encoded with, on this machine (None: there is none).
    tokenizer_file: Callable[[DataConfig], Path | None] = no_tokenizer


def cache_root(cfg: DataConfig) -> Path:
    """The directory for built caches; the only place SDP_CACHE_DIR is read."""
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    return Path(os.environ.get("SDP_CACHE_DIR") or "~/.cache/sdp").expanduser()


def require_at_least(cfg: DataConfig, *names: str, minimum: int) -> None:
    """Raise ConfigError unless each named int field is >= minimum."""
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ConfigError(f"dataset.{name}", value, f"must be an integer >= {minimum}")


def require_equal(cfg: DataConfig, name: str, *, expected: object, why: str) -> None:
    """Raise ConfigError unless the field equals the one value this dataset supports."""
    value = getattr(cfg, name)
    if value != expected:
        raise ConfigError(f"dataset.{name}", value, f"must be {expected!r} for dataset.name={cfg.name!r} ({why})")


def no_vocab(cfg: DataConfig) -> None:
    """`vocab_size` hook of image datasets."""
    return None


def nothing_to_prepare(cfg: DataConfig) -> None:
    """`prepare` hook of datasets that build no cache."""


@contextlib.contextmanager
def reading(path: Path, *, rebuild: str):
    """A data or cache file read inside this block: any failure to decode it (truncated, corrupt,
    not what it should be) is one DamagedFile naming it, with `rebuild`: how to get it whole again."""
    try:
        yield
    except DamagedFile:
        raise
    except Exception as err:  # noqa: BLE001 - every decoder fails its own way; each is one line
        raise DamagedFile(path, f"is truncated or corrupt ({describe(err)}); {rebuild}") from None
