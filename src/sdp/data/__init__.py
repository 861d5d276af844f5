"""Datasets for sdp: config, validation, cache preparation and per-rank batch streams.

A batch is {"inputs": Tensor, "targets": Tensor} for every dataset, so one loss,
cross_entropy(logits.flatten(0, -2), targets.flatten()), serves text and images.
"""

from sdp.data.api import build_data, data_tokenizer_file, data_vocab_size, prepare_data, validate_data
from sdp.data.core import DataBundle, DataConfig

__all__ = [
    "DataBundle",
    "DataConfig",
    "build_data",
    "data_tokenizer_file",
    "data_vocab_size",
    "prepare_data",
    "validate_data",
]
