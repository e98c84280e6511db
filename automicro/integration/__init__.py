"""Composer integration: `automicro.Trainer`, the `AutoMicrobatching` callback, checkpointing,
the YAML builders. The only layer that imports Composer's trainer.

May not touch: private Composer outside `_composer_internals`, the test kit at import time.
"""
