"""Download-free datasets (synthetic tokens, byte-level local text, variable-length tokens with a
padding collator) and a rank-aware dataloader."""

from automicro.data.datasets import (
    ByteTextCorpus,
    DataError,
    SyntheticTokens,
    build_dataloader,
    default_text_paths,
)
from automicro.data.varlen import TokenCounter, VariableLengthTokens, count_tokens, pad_collate

__all__ = [
    "SyntheticTokens",
    "ByteTextCorpus",
    "VariableLengthTokens",
    "build_dataloader",
    "count_tokens",
    "TokenCounter",
    "default_text_paths",
    "pad_collate",
    "DataError",
]
