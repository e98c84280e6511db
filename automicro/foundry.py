"""llm-foundry's own train path with automicro's Trainer and FSDP2 engine.

    composer -n 8 -m automicro.foundry their-train.yaml [key=value ...]

An llm-foundry user keeps their YAML (model, tokenizer, data loaders, optimizer, scheduler,
callbacks, loggers: llm-foundry builds them all through its registries) and changes one line:
``device_train_microbatch_size: auto``. Their ``fsdp_config`` (FSDP1, Composer's) is mapped onto
automicro's FSDP2 engine (`composer.composer_config.fsdp2_from_fsdp1`: one line on rank 0 for
each key without an FSDP2 meaning); ``parallelism_config: {fsdp2: {...}}`` (automicro's
`FSDP2Config`) sets the engine directly instead. Overrides are dotted keys with YAML values, as
for llm-foundry's `train.py`.

What it adds to llm-foundry's registries: callbacks ``auto_microbatching`` (`AutoMicrobatching`,
its settings) and ``memory_cap`` (an emulated per-rank memory limit for CPU runs), and the data
loader ``automicro_synthetic`` (random tokens: ``num_samples``, ``seq_len``, ``vocab_size``,
``seed``), and the tokenizer ``automicro_bytes`` (bytes, built in memory). Needs the extra:
``pip install -e '.[foundry]'`` (llm-foundry 0.22.0, torch 2.7.0).

A bad config prints one ``config error:`` line (local rank 0 of each node) and exits with 2.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from automicro.engine.config import FSDP2Config, FSDP2ConfigError, fsdp2_from_parallelism_config
from automicro.composer import _foundry_internals as internals
from automicro.composer._foundry_internals import FoundryUnavailable

USAGE = "usage: composer -n N -m automicro.foundry TRAIN.yaml [key=value ...]  (llm-foundry YAML; see docs/guides/composer.md, llm-foundry)"


class FoundryConfigError(ValueError):
    """A foundry YAML that cannot run with automicro; the message says what to change."""


def load_config(path: str, overrides: list[str]) -> Any:
    """The YAML with its dotted overrides, resolved (llm-foundry's `train_from_yaml` does the same)."""
    from omegaconf import OmegaConf

    if not os.path.isfile(path):
        raise FoundryConfigError(f"{path}: no such file (the first argument is the llm-foundry train YAML)")
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise FoundryConfigError(f"overrides must be key=value, got {bad}")
    cfg = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(overrides))
    OmegaConf.resolve(cfg)
    return cfg


def take_fsdp2(cfg: Any) -> tuple[Optional[FSDP2Config], Optional[str]]:
    """Remove the sharding settings from `cfg` (llm-foundry refuses keys it does not know) and
    return (automicro's FSDP2 settings, the checkpoint format they ask for or None). Either an
    FSDP1 ``fsdp_config`` as llm-foundry writes it (mapped onto the engine: `fsdp2_from_fsdp1`,
    one line on rank 0 for each key without an FSDP2 meaning) or automicro's
    ``parallelism_config: {fsdp2: {...}}``; both at once, or tensor parallelism, is refused."""
    from omegaconf import OmegaConf

    from automicro.composer.composer_config import fsdp2_from_fsdp1

    if cfg.get("tp_config") is not None:
        raise FoundryConfigError(
            "tp_config: tensor parallelism is not what automicro shards with; remove tp_config "
            "(automicro's FSDP2 engine shards over every rank)"
        )
    fsdp1 = cfg.get("fsdp_config")
    if fsdp1 is not None and cfg.get("parallelism_config") is not None:
        raise FoundryConfigError(
            "fsdp_config and parallelism_config are both set: keep one (fsdp_config as llm-foundry writes it is "
            "mapped onto automicro's FSDP2 engine; parallelism_config: {fsdp2: {...}} sets the engine directly)"
        )
    if fsdp1 is not None:
        cfg.pop("fsdp_config")
        if "parallelism_config" in cfg:  # set to null
            cfg.pop("parallelism_config")
        mapping = OmegaConf.to_container(fsdp1, resolve=True) if OmegaConf.is_config(fsdp1) else dict(fsdp1)
        import torch

        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        device = "gpu" if torch.cuda.is_available() else "cpu"
        engine, checkpoint_format, lines = fsdp2_from_fsdp1(mapping, cfg.get("precision"), device, world, local)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[automicro] fsdp_config mapped onto the FSDP2 engine: {engine}", flush=True)
            for line in lines:
                print(f"[automicro] {line}", flush=True)
        return engine, checkpoint_format
    if "parallelism_config" not in cfg:
        return FSDP2Config(), None
    value = cfg.pop("parallelism_config")
    value = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return fsdp2_from_parallelism_config(value), None


def _trainer_factory(fsdp2: Optional[FSDP2Config], checkpoint_format: Optional[str] = None) -> Any:
    def build(**kwargs: Any) -> Any:
        from automicro.composer.trainer import Trainer

        stock = kwargs.pop("parallelism_config", None) or {}
        if stock.get("tp") is not None:
            raise FoundryConfigError("tensor parallelism (tp_config) is not supported with automicro")
        kwargs["parallelism_config"] = None if fsdp2 is None else {"fsdp2": fsdp2}
        if checkpoint_format is not None:
            kwargs["checkpoint_format"] = checkpoint_format
        internals.stage_hf_exports(kwargs.get("callbacks") or [])  # the hf_checkpointer export, atomic
        return Trainer(**kwargs)

    return build


def synthetic_dataloader(
    tokenizer: Any,
    device_batch_size: Any,
    num_samples: int,
    seq_len: int,
    vocab_size: int,
    seed: int = 0,
    shuffle: bool = False,
    drop_last: bool = True,
    num_workers: int = 0,
) -> Any:
    """llm-foundry data loader ``automicro_synthetic``: uniformly random token sequences, each rank
    its own shard (`automicro.data`)."""
    from automicro.data import SyntheticTokens, build_dataloader

    dataset = SyntheticTokens(num_samples, seq_len, vocab_size, seed=seed)
    return build_dataloader(
        dataset, int(device_batch_size), shuffle=shuffle, seed=seed, drop_last=drop_last, num_workers=num_workers
    )


def byte_tokenizer_class() -> type:
    """llm-foundry tokenizer ``automicro_bytes``: one token per byte plus ``<|endoftext|>`` (257
    tokens), built in memory (no files, no network); keyword arguments go to
    `PreTrainedTokenizerFast`. (A class: llm-foundry's tokenizer registry takes classes.)"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    class ByteTokenizer(PreTrainedTokenizerFast):
        def __init__(self, **kwargs: Any) -> None:
            alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
            vocab = {char: index for index, char in enumerate(alphabet)}
            vocab["<|endoftext|>"] = len(vocab)
            tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
            tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tokenizer.decoder = decoders.ByteLevel()
            kwargs.setdefault("eos_token", "<|endoftext|>")
            super().__init__(tokenizer_object=tokenizer, **kwargs)

    return ByteTokenizer


def register_components() -> None:
    from automicro.composer.callback import AutoMicrobatching
    from automicro.testing.callbacks import MemoryCapCallback
    from automicro.testing.checkpoint_faults import CheckpointFault

    internals.register("callbacks", "auto_microbatching", AutoMicrobatching)
    internals.register("callbacks", "memory_cap", MemoryCapCallback)
    internals.register("callbacks", "checkpoint_fault", CheckpointFault)
    internals.register("dataloaders", "automicro_synthetic", synthetic_dataloader)
    internals.register("tokenizers", "automicro_bytes", byte_tokenizer_class())


def _say(error: BaseException) -> None:
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"config error: {error}", file=sys.stderr, flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    try:
        internals.check_llmfoundry()
        cfg = load_config(args[0], args[1:])
        fsdp2, checkpoint_format = take_fsdp2(cfg)
    except (FoundryUnavailable, FoundryConfigError, FSDP2ConfigError) as error:
        _say(error)
        return 2
    register_components()
    with internals.trainer_class(_trainer_factory(fsdp2, checkpoint_format)):
        trainer = internals.train_function()(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        for line in summary_lines(trainer):
            print(line, flush=True)
    trainer.close()
    from automicro.composer.callback import AutoMicrobatching
    from automicro.core import exit_watch

    # The run finished: what holds the exit after it is bounded (torch inductor's compile workers after a cold start).
    auto = next((c for c in trainer.state.callbacks if isinstance(c, AutoMicrobatching)), None)
    exit_watch.arm_finished(auto.settings.exit_timeout_s if auto is not None else exit_watch.DEFAULT_TIMEOUT_S,
                            int(os.environ.get("RANK", "0")))
    return 0


def summary_lines(trainer: Any) -> list[str]:
    """What the search found, for the console (the same words as scripts/train.py)."""
    from automicro.composer.callback import AutoMicrobatching

    auto = next((c for c in trainer.state.callbacks if isinstance(c, AutoMicrobatching)), None)
    found = None if auto is None else auto.summary_line()
    if found is None:
        return [f"[automicro] fixed microbatch size {trainer.state.device_train_microbatch_size}"]
    return [f"{found}; {int(trainer.state.timestamp.batch)} batches"]


if __name__ == "__main__":
    sys.exit(main())
