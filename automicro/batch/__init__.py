"""The batch step every training loop shares: one batch's attempts, whoever owns the loop.

The split (by samples, by token budget, packed rows, a pipeline's), the attempt fence and the
consensus around the loop's own microbatch loop, the wipe after a failed attempt, the search for
the microbatch size, the layout and size trials, memory truth, the settings and the torch host
that `automicro.AutoStep` (a plain PyTorch loop, the Hugging Face Trainer, Lightning) runs on.
Composer's Trainer reaches it through `automicro.composer`.

May import: `automicro.core`, `automicro.engine`, `automicro.data`, torch. May not import: any
training framework (Composer, transformers, Lightning, accelerate, llm-foundry), nor anything
above it (`tests/test_layers.py` fails on such an import).
"""
