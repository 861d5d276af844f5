"""Finding, loading, training and applying tokenizers (always as a `tokenizers.Tokenizer`)."""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from sdp.data.core import DataConfig, reading
from sdp.errors import ConfigError

TOKENIZER_FILE = "tokenizer.json"
# Spellings of the end-of-text token in common tokenizers, tried in order.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
UNK_CANDIDATES = ("<unk>", "[UNK]", "<|unk|>")
# The special token of locally trained tokenizers.
LOCAL_EOS = "<|endoftext|>"


@dataclass(frozen=True)
class TextTokenizer:
    """A loaded tokenizer and the ids the packing step needs."""

    tokenizer: Tokenizer
    eos_id: int
    unk_id: int | None
    size: int  # every id it can produce, added tokens included


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~")) or value.endswith(".json")


def _local_tokenizer_file(value: str) -> Path:
    """The tokenizer.json that a local file or directory value names."""
    path = Path(value).expanduser()
    if path.is_dir():
        path = path / TOKENIZER_FILE
        if not path.is_file():
            raise ConfigError(
                "dataset.tokenizer", value, f"directory holds no {TOKENIZER_FILE}; give a tokenizer.json or a hub id"
            )
    return path


def _cached_hub_file(repo_id: str) -> Path | None:
    """tokenizer.json of a hub repo if the local HF cache has it, else None."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached = try_to_load_from_cache(repo_id, TOKENIZER_FILE)
    except HFValidationError:
        raise ConfigError(
            "dataset.tokenizer", repo_id, "is neither an existing path nor a valid Hugging Face Hub id"
        ) from None
    return Path(cached) if isinstance(cached, str) else None


def find_tokenizer_file(cfg: DataConfig, *, offline: bool) -> Path | None:
    """The tokenizer.json to load without network access, or None if it must be downloaded.

    Raises ConfigError for a missing local path, or for a hub id that is not
    cached while `offline`.
    """
    value = cfg.tokenizer
    if not value:
        raise ConfigError(
            "dataset.tokenizer",
            value,
            f"dataset.name={cfg.name!r} needs a tokenizer: a hub id or a tokenizer.json path",
        )
    if Path(value).expanduser().exists():
        return _local_tokenizer_file(value)
    if _looks_like_path(value):
        raise ConfigError(
            "dataset.tokenizer", value, "file or directory does not exist; give a tokenizer.json path or a hub id"
        )
    cached = _cached_hub_file(value)
    if cached is None and offline:
        raise ConfigError(
            "dataset.tokenizer",
            value,
            f"hub tokenizer whose {TOKENIZER_FILE} is not in the local Hugging Face cache while HF_HUB_OFFLINE is set; "
            "set it to a local tokenizer.json path, or unset HF_HUB_OFFLINE",
        )
    return cached


def _download_tokenizer_file(repo_id: str) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(hf_hub_download(repo_id, TOKENIZER_FILE))
    except (EntryNotFoundError, RepositoryNotFoundError) as err:
        raise ConfigError(
            "dataset.tokenizer",
            repo_id,
            f"hub repo has no {TOKENIZER_FILE} ({type(err).__name__}); give a local tokenizer.json",
        ) from None


def _first_known(tokenizer: Tokenizer, candidates: Iterable[str]) -> int | None:
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    return None


def wrap_tokenizer(tokenizer: Tokenizer, *, eos_token: str | None) -> TextTokenizer:
    """Find the EOS and unknown ids of a tokenizer; ConfigError if it has no EOS."""
    candidates = [eos_token] if eos_token else list(EOS_CANDIDATES)
    eos_id = _first_known(tokenizer, candidates)
    if eos_id is None:
        raise ConfigError(
            "dataset.eos_token", eos_token, f"the tokenizer knows none of {candidates}; set it to its end-of-text token"
        )
    # Text that mentions "<|endoftext|>" must not inject document boundaries, so added
    # special tokens are not split out before the model runs; a byte-level BPE then
    # spells them in ordinary tokens. (A Unigram vocab like T5's can still match its
    # special pieces; encode_docs's id guard covers the ones above the vocab cut.)
    tokenizer.encode_special_tokens = True
    return TextTokenizer(tokenizer, eos_id, _first_known(tokenizer, UNK_CANDIDATES), tokenizer.get_vocab_size())


def load_tokenizer(cfg: DataConfig) -> TextTokenizer:
    """Load the configured pretrained tokenizer, downloading tokenizer.json if needed."""
    path = find_tokenizer_file(cfg, offline=False) or _download_tokenizer_file(cfg.tokenizer)
    with reading(path, rebuild="replace it: a hub tokenizer's copy is fetched again once deleted (online)"):
        tokenizer = Tokenizer.from_file(str(path))
    return wrap_tokenizer(tokenizer, eos_token=cfg.eos_token)


def id_limit(cfg: DataConfig, tok: TextTokenizer) -> int:
    """Every emitted id is below this: vocab_size caps the tokenizer's ids (0 = no cap)."""
    return min(cfg.vocab_size, tok.size) if cfg.vocab_size > 0 else tok.size


def check_id_limit(cfg: DataConfig, tok: TextTokenizer) -> None:
    """ConfigError unless ids cut by vocab_size can become <unk> and EOS survives the cut."""
    limit = id_limit(cfg, tok)
    if tok.eos_id >= limit:
        raise ConfigError("dataset.vocab_size", cfg.vocab_size, f"must exceed the tokenizer's EOS id {tok.eos_id}")
    if limit < tok.size and (tok.unk_id is None or tok.unk_id >= limit):
        raise ConfigError(
            "dataset.vocab_size",
            cfg.vocab_size,
            f"cuts the tokenizer's {tok.size} ids but it has no unknown token below the cut to stand in; "
            f"set it to 0 or >= {tok.size}",
        )


def encode_docs(tok: TextTokenizer, texts: list[str], *, limit: int) -> np.ndarray:
    """Token ids of the documents, each followed by EOS, as one int64 array.

    Ids >= limit become the unknown token. With T5 and limit 32000 that only hits
    the <extra_id_N> sentinels (ids 32000-32099), which plain text produces only
    where it literally spells "<extra_id_N>"; this is the packing-time guard that
    keeps every id inside the vocab the model was promised.
    """
    if not texts:
        return np.empty(0, dtype=np.int64)
    encodings = tok.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    eos = np.array([tok.eos_id], dtype=np.int64)
    ids = np.concatenate([part for enc in encodings for part in (np.asarray(enc.ids, dtype=np.int64), eos)])
    if limit < tok.size:
        ids[ids >= limit] = tok.unk_id
    return ids


def train_bpe(texts: Iterator[str], *, vocab_size: int) -> TextTokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style) with <|endoftext|> as EOS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[LOCAL_EOS],
        # All 256 bytes up front, so no input can ever need an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return wrap_tokenizer(tokenizer, eos_token=LOCAL_EOS)
