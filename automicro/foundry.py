"""llm-foundry's own train path with automicro's Trainer and FSDP2 engine.

    composer -n 8 -m automicro.foundry their-train.yaml [key=value ...]

An llm-foundry user keeps their YAML (model, tokenizer, data loaders, optimizer, scheduler,
callbacks, loggers: llm-foundry builds them all through its registries) and changes two things:
``device_train_microbatch_size: auto``, and ``parallelism_config: {fsdp2: {...}}`` (automicro's
`FSDP2Config`, defaults when left out) in place of ``fsdp_config`` (FSDP1, Composer's). Overrides
are dotted keys with YAML values, as for llm-foundry's `train.py`.

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
from automicro.integration import _foundry_internals as internals
from automicro.integration._foundry_internals import FoundryUnavailable

USAGE = "usage: composer -n N -m automicro.foundry TRAIN.yaml [key=value ...]  (llm-foundry YAML; see README 'llm-foundry')"


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


def take_fsdp2(cfg: Any) -> Optional[FSDP2Config]:
    """Remove automicro's `parallelism_config` from `cfg` (llm-foundry refuses keys it does not
    know) and return its FSDP2 settings; refuse FSDP1 / tensor-parallel settings beside it."""
    from omegaconf import OmegaConf

    for key, what in (("fsdp_config", "FSDP1 (Composer's)"), ("tp_config", "tensor parallelism")):
        if cfg.get(key) is not None:
            raise FoundryConfigError(
                f"{key}: {what} is not what automicro shards with; remove {key} and set "
                "parallelism_config: {fsdp2: {...}} (automicro's FSDP2 engine; {} = defaults; keys in "
                "automicro/engine/config.py)"
            )
    if "parallelism_config" not in cfg:
        return FSDP2Config()
    value = cfg.pop("parallelism_config")
    value = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return fsdp2_from_parallelism_config(value)


def _trainer_factory(fsdp2: Optional[FSDP2Config]) -> Any:
    def build(**kwargs: Any) -> Any:
        from automicro.integration.trainer import Trainer

        stock = kwargs.pop("parallelism_config", None) or {}
        if stock.get("tp") is not None:
            raise FoundryConfigError("tensor parallelism (tp_config) is not supported with automicro")
        kwargs["parallelism_config"] = None if fsdp2 is None else {"fsdp2": fsdp2}
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
    from automicro.integration.callback import AutoMicrobatching
    from automicro.testing.callbacks import MemoryCapCallback

    internals.register("callbacks", "auto_microbatching", AutoMicrobatching)
    internals.register("callbacks", "memory_cap", MemoryCapCallback)
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
        fsdp2 = take_fsdp2(cfg)
    except (FoundryUnavailable, FoundryConfigError, FSDP2ConfigError) as error:
        _say(error)
        return 2
    register_components()
    with internals.trainer_class(_trainer_factory(fsdp2)):
        trainer = internals.train_function()(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        for line in summary_lines(trainer):
            print(line, flush=True)
    trainer.close()
    return 0


def summary_lines(trainer: Any) -> list[str]:
    """What the search found, for the console (the same words as scripts/train.py)."""
    from automicro.integration.callback import AutoMicrobatching

    auto = next((c for c in trainer.state.callbacks if isinstance(c, AutoMicrobatching)), None)
    if auto is None or auto.policy is None:
        return [f"[automicro] fixed microbatch size {trainer.state.device_train_microbatch_size}"]
    return [
        f"[automicro] microbatch size found: {auto.found_size}; split in use {list(auto.policy.current_split())}; "
        f"attempts {len(auto.history)}, OOMs {auto.ooms_total}; sync hooks {'on' if auto.hooks_active else 'off'}; "
        f"{int(trainer.state.timestamp.batch)} batches"
    ]


if __name__ == "__main__":
    sys.exit(main())
