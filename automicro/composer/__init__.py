"""The Composer integration: `automicro.Trainer`, the `AutoMicrobatching` callback, Composer's host
for the batch step, checkpoints, the eval search, loggers, the YAML builders, llm-foundry's hooks.
The only layer that imports Composer's trainer; the batch step itself is `automicro.batch`.

May not touch: private Composer outside `_composer_internals` (llm-foundry's: `_foundry_internals`),
the test kit at import time.
"""
