"""Models for automicro's examples and benchmarks: a Llama-style decoder and its Composer wrapper."""

from automicro.models.llama import PRESETS, ComposerLlama, Llama, LlamaConfig, build_model

__all__ = ["LlamaConfig", "Llama", "ComposerLlama", "build_model", "PRESETS"]
