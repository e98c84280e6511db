"""Download-free datasets (synthetic tokens, byte-level local text) and a rank-aware dataloader."""

from automicro.data.datasets import (
    ByteTextCorpus,
    DataError,
    SyntheticTokens,
    build_dataloader,
    default_text_paths,
)

__all__ = ["SyntheticTokens", "ByteTextCorpus", "build_dataloader", "default_text_paths", "DataError"]
