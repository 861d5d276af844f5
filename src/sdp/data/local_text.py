"""local_text: a directory of text files (default: the Python standard library).

prepare trains a byte-level BPE tokenizer on the train files and tokenises the
corpus; both are cached under cache_dir/local_text/<key>, where the key hashes
the file list with sizes and every setting that changes the result.
"""

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from sdp.data.core import DataBundle, DataConfig, DatasetSpec, Placement, cache_root, reading, require_at_least
from sdp.data.packing import token_bundle
from sdp.data.tokenizer import LOCAL_EOS, TextTokenizer, encode_docs, train_bpe, wrap_tokenizer
from sdp.errors import ConfigError
from sdp.paths import check_writable

# Bump when the cache layout or tokenizer recipe changes, so old caches are not reused.
CACHE_VERSION = 1
# Files per encode call: bounds the memory held by tokenizers' Encoding objects.
ENCODE_FILES = 256
# A byte-level BPE needs its 256 byte tokens plus the EOS token.
MIN_VOCAB = 257
SPLITS = ("train", "eval")


def corpus_root(cfg: DataConfig) -> Path:
    """The configured directory, or the standard library's source directory when path is null."""
    return Path(cfg.path).expanduser() if cfg.path else Path(sysconfig.get_paths()["stdlib"])


def list_files(cfg: DataConfig) -> list[tuple[str, int]]:
    """(relative path, size in bytes) of the corpus files, sorted, within max_files/max_bytes."""
    root = corpus_root(cfg)
    found = []
    for path in root.glob(cfg.text_glob):
        relative = path.relative_to(root)
        if path.is_file() and not set(cfg.exclude).intersection(relative.parts):
            found.append((relative.as_posix(), path.stat().st_size))
    return _cap(sorted(found), max_files=cfg.max_files, max_bytes=cfg.max_bytes)


def _cap(files: list[tuple[str, int]], *, max_files: int, max_bytes: int) -> list[tuple[str, int]]:
    """The longest prefix within both limits (0 = no limit)."""
    kept, total = [], 0
    for name, size in files:
        if (max_files and len(kept) == max_files) or (max_bytes and total + size > max_bytes):
            break
        kept.append((name, size))
        total += size
    return kept


def split_files(files: list[tuple[str, int]], *, eval_every: int) -> dict[str, list[str]]:
    """Every eval_every-th file (in sorted order, starting with the first) is eval, the rest train."""
    names = [name for name, _ in files]
    return {
        "train": [n for i, n in enumerate(names) if i % eval_every],
        "eval": [n for i, n in enumerate(names) if not i % eval_every],
    }


def cache_dir_for(cfg: DataConfig, files: list[tuple[str, int]]) -> Path:
    """The cache directory keyed by the file list and the settings that shape the cache."""
    key = {
        "version": CACHE_VERSION,
        "root": str(corpus_root(cfg).resolve()),
        "glob": cfg.text_glob,
        "files": files,
        "vocab_size": cfg.vocab_size,
        "eval_every": cfg.eval_every,
    }
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    return cache_root(cfg) / "local_text" / digest


def _is_complete(directory: Path) -> bool:
    return (directory / "tokenizer.json").is_file() and all((directory / f"{s}.npy").is_file() for s in SPLITS)


def _read_texts(root: Path, names: list[str]) -> Iterator[str]:
    for name in names:
        # Some stdlib test files are deliberately not UTF-8; a few replaced bytes do no harm.
        yield (root / name).read_text(encoding="utf-8", errors="replace")


def _atomic_target(path: Path) -> Path:
    """A temporary name beside `path`; writing there then os.replace never leaves a partial file."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _tokenizer(cfg: DataConfig, directory: Path, train_names: list[str]) -> TextTokenizer:
    """Load the cached tokenizer, or train it on the train files and cache it."""
    path = directory / "tokenizer.json"
    if path.is_file():
        with reading(path, rebuild=_rebuild(directory)):
            return wrap_tokenizer(Tokenizer.from_file(str(path)), eos_token=LOCAL_EOS)
    tok = train_bpe(_read_texts(corpus_root(cfg), train_names), vocab_size=cfg.vocab_size)
    tmp = _atomic_target(path)
    tok.tokenizer.save(str(tmp))
    os.replace(tmp, path)
    return tok


def _write_tokens(cfg: DataConfig, tok: TextTokenizer, names: list[str], path: Path) -> None:
    """Tokenise the files (each followed by EOS) into a uint16/uint32 .npy file."""
    root = corpus_root(cfg)
    dtype = np.uint16 if cfg.vocab_size <= 2**16 else np.uint32
    chunks = [
        encode_docs(tok, list(_read_texts(root, names[i : i + ENCODE_FILES])), limit=cfg.vocab_size).astype(dtype)
        for i in range(0, len(names), ENCODE_FILES)
    ]
    tmp = _atomic_target(path)
    with open(tmp, "wb") as f:
        np.save(f, np.concatenate(chunks))
    os.replace(tmp, path)


def validate(cfg: DataConfig, *, offline: bool) -> None:
    """Check the sizes, that the directory exists and that it yields train and eval files."""
    require_at_least(cfg, "seq_len", minimum=1)
    require_at_least(cfg, "vocab_size", minimum=MIN_VOCAB)
    require_at_least(cfg, "eval_every", minimum=2)
    require_at_least(cfg, "max_files", "max_bytes", minimum=0)
    root = corpus_root(cfg)
    if not root.is_dir():
        raise ConfigError(
            "dataset.path",
            cfg.path,
            "directory does not exist; set it to a directory of text files, or null for the stdlib",
        )
    files = list_files(cfg)
    if len(files) < 2:
        raise ConfigError(
            "dataset.text_glob",
            cfg.text_glob,
            f"matches {len(files)} files under {root} after dataset.exclude/max_files/max_bytes; "
            "need >= 2 (train and eval)",
        )
    directory = cache_dir_for(cfg, files)
    if not _is_complete(directory):  # a complete cache is only read: a read-only one is fine
        check_writable("dataset.cache_dir", directory)


def prepare(cfg: DataConfig) -> None:
    """Train and cache the tokenizer and the token arrays; a no-op when the cache is complete."""
    files = list_files(cfg)
    directory = cache_dir_for(cfg, files)
    if _is_complete(directory):
        return
    directory.mkdir(parents=True, exist_ok=True)
    names = split_files(files, eval_every=cfg.eval_every)
    tok = _tokenizer(cfg, directory, names["train"])
    for split in SPLITS:
        if not (directory / f"{split}.npy").is_file():
            _write_tokens(cfg, tok, names[split], directory / f"{split}.npy")


def build(cfg: DataConfig, place: Placement) -> DataBundle:
    """Memory-map the cached token arrays and shard their rows across ranks."""
    directory = cache_dir_for(cfg, list_files(cfg))
    if not _is_complete(directory):
        raise RuntimeError(f"no complete local_text cache at {directory}: call prepare_data before build_data")
    train, evaluation = (_load_tokens(directory / f"{s}.npy") for s in SPLITS)
    return token_bundle(cfg, train, evaluation, place)


def _rebuild(directory: Path) -> str:
    return f"delete {directory} and run again: it is rebuilt from dataset.path"


def _load_tokens(path: Path) -> np.ndarray:
    """A cached token array (memory-mapped); DamagedFile naming it when it cannot be read."""
    with reading(path, rebuild=_rebuild(path.parent)):
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or tokens.dtype.kind != "u":
            raise ValueError(f"holds {tokens.dtype} {tokens.shape}, not a 1-D array of token ids")
        return tokens


def vocab_size(cfg: DataConfig) -> int:
    """The trained tokenizer has at most vocab_size ids."""
    return cfg.vocab_size


def tokenizer_file(cfg: DataConfig) -> Path | None:
    """The tokenizer trained for this corpus and these settings, once prepare has cached it."""
    path = cache_dir_for(cfg, list_files(cfg)) / "tokenizer.json"
    return path if path.is_file() else None


SPEC = DatasetSpec(
    kind="text", validate=validate, prepare=prepare, build=build, vocab_size=vocab_size, tokenizer_file=tokenizer_file
)
