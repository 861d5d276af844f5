"""fineweb: FineWeb streamed with HF datasets (or a local directory of parquet/jsonl
files in the same shape), tokenised on the fly and packed into rows.

Eval is the first eval_docs documents of the unshuffled stream; train is every
other document. Train drops the eval documents by a hash of their text rather
than with `IterableDataset.skip`, because skip splits its count across shards
once the stream is sharded by node or worker, and would then drop the wrong
ones; the hash also keeps exact duplicates of eval documents out of train.
"""

import hashlib
import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer

from sdp.data.core import DataBundle, DataConfig, DatasetSpec, Placement, require_at_least
from sdp.data.loaders import eval_limit, eval_shard, repeat_epochs
from sdp.data.packing import as_rows, packed_batches, rows_to_batch
from sdp.data.tokenizer import (
    TextTokenizer,
    check_id_limit,
    encode_docs,
    find_tokenizer_file,
    id_limit,
    load_tokenizer,
    wrap_tokenizer,
)
from sdp.errors import ConfigError

if TYPE_CHECKING:
    from datasets import IterableDataset

# Documents per encode call: large enough for tokenizers' threads, small enough to start fast.
TOKENIZE_DOCS = 64
# Local file formats and the `datasets` builder that reads them, in order of preference.
LOCAL_FORMATS = (("parquet", ("*.parquet",)), ("json", ("*.jsonl", "*.json")))


def local_dir(cfg: DataConfig) -> Path | None:
    """The path as a local directory, or None when it names a hub dataset."""
    path = Path(cfg.path).expanduser()
    return path if path.is_dir() else None


def local_files(directory: Path) -> tuple[str, list[str]]:
    """(builder, sorted files) of the first format present under the directory."""
    for builder, patterns in LOCAL_FORMATS:
        files = sorted(str(p) for pattern in patterns for p in directory.rglob(pattern))
        if files:
            return builder, files
    return "", []


def open_stream(cfg: DataConfig) -> "IterableDataset":
    """The unshuffled document stream (an IterableDataset holding only the text column)."""
    from datasets import load_dataset

    directory = local_dir(cfg)
    if directory is None:
        stream = load_dataset(cfg.path, name=cfg.hub_config, split=cfg.hub_split, streaming=True)
    else:
        builder, files = local_files(directory)
        stream = load_dataset(builder, data_files=files, split="train", streaming=True)
    if stream.column_names is not None and cfg.text_column not in stream.column_names:
        raise ConfigError("dataset.text_column", cfg.text_column, f"not a column of {cfg.path}: {stream.column_names}")
    return stream.select_columns([cfg.text_column])


def _texts(stream: Iterable[dict], column: str) -> Iterator[str]:
    for example in stream:
        yield example[column]


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _token_chunks(texts: Iterable[str], tok: TextTokenizer, *, limit: int) -> Iterator[np.ndarray]:
    """Token ids of TOKENIZE_DOCS documents at a time, each document followed by EOS."""
    texts = iter(texts)
    while batch := list(itertools.islice(texts, TOKENIZE_DOCS)):
        yield encode_docs(tok, batch, limit=limit)


def _eval_rows(cfg: DataConfig, texts: list[str], *, tok: TextTokenizer, place: Placement) -> np.ndarray:
    """This rank's share of the packed eval rows (the same count on every rank)."""
    tokens = np.concatenate([np.empty(0, dtype=np.int64), *_token_chunks(texts, tok, limit=id_limit(cfg, tok))])
    rows = as_rows(tokens, seq_len=cfg.seq_len)
    if len(rows) < place.world_size:
        raise ConfigError(
            "dataset.eval_docs",
            cfg.eval_docs,
            f"gives {len(rows)} rows of seq_len+1 tokens, fewer than the {place.world_size} ranks; raise it",
        )
    shard = eval_shard(len(rows), rank=place.rank, world_size=place.world_size, limit=eval_limit(cfg, place))
    return rows[np.asarray(shard)]


def _train_batches(
    cfg: DataConfig, stream: "IterableDataset", *, tok: TextTokenizer, place: Placement, skip: set[bytes]
) -> Iterator[dict]:
    """Infinite full batches from this rank's part of the shuffled stream, eval documents left out.

    Every rank shuffles with the same seed (datasets adds the epoch), which
    split_dataset_by_node needs to hand out disjoint shards or examples.
    """
    from datasets.distributed import split_dataset_by_node

    train = stream.filter(lambda example: _digest(example[cfg.text_column]) not in skip)
    shuffled = train.shuffle(seed=place.seed, buffer_size=cfg.shuffle_buffer)
    mine = split_dataset_by_node(shuffled, rank=place.rank, world_size=place.world_size)
    limit = id_limit(cfg, tok)

    def epoch_pass(epoch: int) -> Iterator[dict]:
        mine.set_epoch(epoch)
        chunks = _token_chunks(_texts(mine, cfg.text_column), tok, limit=limit)
        return packed_batches(chunks, seq_len=cfg.seq_len, batch_size=place.batch_size)

    # A streamed dataset cannot seek: a resumed run reads past the batches it already trained on.
    return _after(repeat_epochs(epoch_pass), place.start_batch)


def _after(batches: Iterator[dict], count: int) -> Iterator[dict]:
    """The batches after the first `count` (a generator: closing it closes `batches`)."""
    try:
        yield from itertools.islice(batches, count, None)
    finally:
        batches.close()


def _validate_path(cfg: DataConfig, *, offline: bool) -> None:
    if not cfg.path:
        raise ConfigError("dataset.path", cfg.path, "set it to a hub dataset id or a directory of *.parquet/*.jsonl")
    directory = local_dir(cfg)
    if directory is not None:
        if not local_files(directory)[1]:
            raise ConfigError("dataset.path", cfg.path, "directory holds no *.parquet, *.jsonl or *.json files")
    elif cfg.path.startswith(("/", ".", "~")):
        raise ConfigError("dataset.path", cfg.path, "directory does not exist; give a directory of *.parquet/*.jsonl")
    elif offline:
        raise ConfigError(
            "dataset.path",
            cfg.path,
            "is a Hugging Face Hub dataset, which streaming needs the network for, while HF_HUB_OFFLINE is set; "
            "set it to a local directory of *.parquet/*.jsonl files, or unset HF_HUB_OFFLINE",
        )


def validate(cfg: DataConfig, *, offline: bool) -> None:
    """Check sizes, the data path and the tokenizer, without touching the network."""
    require_at_least(cfg, "seq_len", "eval_docs", "shuffle_buffer", minimum=1)
    require_at_least(cfg, "vocab_size", minimum=0)
    _validate_path(cfg, offline=offline)
    path = find_tokenizer_file(cfg, offline=offline)
    if path is not None:  # only check what is already on disk; the download waits for prepare
        check_id_limit(cfg, wrap_tokenizer(Tokenizer.from_file(str(path)), eos_token=cfg.eos_token))


def prepare(cfg: DataConfig) -> None:
    """Fetch the tokenizer once, on rank 0, so other ranks find it in the HF cache."""
    load_tokenizer(cfg)


def build(cfg: DataConfig, place: Placement) -> DataBundle:
    """Read and tokenise the eval documents now; stream train batches lazily."""
    tok = load_tokenizer(cfg)
    check_id_limit(cfg, tok)
    stream = open_stream(cfg)
    eval_texts = list(_texts(stream.take(cfg.eval_docs), cfg.text_column))
    rows = _eval_rows(cfg, eval_texts, tok=tok, place=place)

    def make_eval() -> Iterator[dict]:
        return (rows_to_batch(rows[i : i + place.eval_batch_size]) for i in range(0, len(rows), place.eval_batch_size))

    return DataBundle(
        kind="text",
        train=_train_batches(cfg, stream, tok=tok, place=place, skip={_digest(t) for t in eval_texts}),
        make_eval=make_eval,
        num_classes=None,
        vocab_size=id_limit(cfg, tok),
    )


def vocab_size(cfg: DataConfig) -> int:
    """Ids are below the tokenizer's size, capped at vocab_size when that is > 0."""
    return id_limit(cfg, load_tokenizer(cfg))


def tokenizer_file(cfg: DataConfig) -> Path | None:
    """The local tokenizer.json, or the hub tokenizer's in the local cache (None: not there)."""
    return find_tokenizer_file(cfg, offline=False)


SPEC = DatasetSpec(
    kind="text", validate=validate, prepare=prepare, build=build, vocab_size=vocab_size, tokenizer_file=tokenizer_file
)
