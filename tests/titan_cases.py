"""Cases for `automicro.torchtitan` (tests/test_torchtitan.py): torchtitan 0.3.0's own `Trainer` and
llama3 debug model (its config registry's ``llama3_debugmodel``, unchanged but for the CLI overrides
below) on gloo CPU ranks, each rank in-process under the hang watchdog.

The data is generated here (torchtitan's test assets are not in its wheel): a word-level tokenizer
and a JSON-lines corpus of documents of 10-300 words, which torchtitan's text loader packs into
rows of ``seq_len`` tokens with per-document positions, as it packs C4. Every reference is
torchtitan's own `Trainer` with a fixed ``local_batch_size``, no automicro.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import traceback
from typing import Any, Optional

import torch
import torch.distributed as dist

BATCH = 8  # each rank's samples a step
SEQ = 64
WORDS = 1500


def make_assets(folder: str, documents: int = 400, seed: int = 0) -> str:
    """A tokenizer (tokenizer.json + tokenizer_config.json with BOS/EOS) and data/train.jsonl under `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(os.path.join(folder, "data"), exist_ok=True)
    words = [f"w{i}" for i in range(WORDS)]
    vocab = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "[UNK]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, f)
    rng = random.Random(seed)
    with open(os.path.join(folder, "data", "train.jsonl"), "w") as f:
        for _ in range(documents):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(10, 300)))}) + "\n")
    return folder


def argv(assets: str, out: str, steps: int, *extra: str, module: str = "llama3") -> list[str]:
    """torchtitan's command line for its debug model of `module` (llama3; deepseek_v3: routed) on the generated data."""
    return [
        "--module", module, "--config", f"{module}_debugmodel",
        "--hf_assets_path", assets, "--dataloader.dataset_path", os.path.join(assets, "data"),
        "--training.seq_len", str(SEQ), "--training.steps", str(steps), "--debug.seed", "7",
        "--validator.no-enable", "--checkpoint.no-enable", "--dump_folder", out, "--metrics.log_freq", "1",
        # FSDP2's parameters in float32, not torchtitan's default bfloat16: a CPU without bfloat16 matrix units (AVX2
        # only) multiplies bfloat16 about 200x slower than float32 (512 x 256 by 256 x 2,048: 1.79 s against 0.009 s),
        # which took the routed test from 51 s to 484 s on such a CI machine. Its experts stay in bfloat16 (torchtitan
        # casts them itself).
        "--training.mixed_precision_param", "float32",
        *extra,
    ]


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().clone()
    return out


def count_expert_tokens(model: torch.nn.Module) -> list[float]:
    """What each routed layer's token count (torchtitan's ``tokens_per_expert_E``) holds as each of its forwards
    begins, in order: it grows by a microbatch's tokens x experts a token per forward and is zeroed by the optimizer
    step, so its values do not depend on the routing; what a failed attempt wrote and nobody undid shows above them."""
    seen: list[float] = []
    for module in model.modules():
        if isinstance(getattr(module, "tokens_per_expert_E", None), torch.Tensor):
            module.register_forward_pre_hook(lambda m, args: seen.append(float(m.tokens_per_expert_E.sum())))
    return seen


def _error(error: BaseException) -> dict[str, str]:
    return {"type": type(error).__name__, "message": str(error), "traceback": traceback.format_exc()}


def _auto(args: list[str], injectors: tuple = (), stop_at: Optional[int] = None, **settings: Any) -> dict[str, Any]:
    """An AutoTrainer run (`stop_at`: the job ends after that step, as a preempted one does, the config's
    steps and LR schedule unchanged)."""
    from automicro.torchtitan import build

    trainer = build(args + ["--training.local_batch_size", "auto"], log_attempts=False, **settings)
    results: list[dict[str, Any]] = []
    step_once = trainer.train_step

    def recorded(data_iterator: Any) -> None:
        step_once(data_iterator)
        r = trainer.last_step
        results.append({"split": list(r.split), "attempts": r.attempts, "size": r.size, "hooks": trainer.auto.hooks_active,
                        "loss": float(r.loss)})

    trainer.train_step = recorded
    logged: list[dict[str, Any]] = []
    log_once = trainer.metrics_processor.log

    def log(step: int, *args: Any, extra_metrics: Optional[dict[str, Any]] = None, **kwargs: Any) -> Any:
        logged.append({k: v for k, v in (extra_metrics or {}).items() if k.startswith("automicro/")})
        return log_once(step, *args, extra_metrics=extra_metrics, **kwargs)

    trainer.metrics_processor.log = log
    if stop_at is not None:
        trainer.should_continue_training = lambda: trainer.step < stop_at
    auto = trainer.auto
    counts = count_expert_tokens(trainer.model_parts[0])
    for injector in injectors:
        injector.arm(auto.sites, trainer.model_parts[0])
    try:
        trainer.train()
        history = [dataclasses.asdict(h) for h in auto.history]
        state = trainer.state_dict()
        out = {"results": results, "history": history, "params": full_state(trainer.model_parts[0]),
               "metrics": {k: v for k, v in auto.metrics().items() if isinstance(v, (int, float))},
               "state": json.loads(state["automicro"]), "step": trainer.step, "ntokens_seen": trainer.ntokens_seen,
               "batch": trainer.config.training.local_batch_size, "logged": logged, "expert_counts": counts,
               "validation": ({"batch": trainer.validator.batch, "runs": trainer.validator.runs}
                              if trainer.config.validator.enable else None)}
    finally:
        for injector in injectors:
            injector.close_hooks()
        trainer.close()
    return out


def _fixed(args: list[str], local_batch_size: int) -> dict[str, torch.Tensor]:
    """torchtitan's own Trainer, no automicro: each rank's BATCH samples a step at `local_batch_size`."""
    from automicro.torchtitan import _torchtitan_internals as internals
    from automicro.torchtitan import build

    given = "--training.global_batch_size" in args
    world = dist.get_world_size()
    extra = [] if given else ["--training.global_batch_size", str(BATCH * world)]
    trainer = build(args + ["--training.local_batch_size", str(local_batch_size), *extra, "--training.disable_cuda_graphs"])
    internals.sum_reduction_on_gloo(trainer.model_parts)
    counts = count_expert_tokens(trainer.model_parts[0])
    try:
        trainer.train()
        return {"params": full_state(trainer.model_parts[0]), "ntokens_seen": trainer.ntokens_seen, "expert_counts": counts}
    finally:
        trainer.close()


def run(rank: int, world_size: int, folder: str, case: str) -> dict[str, Any]:
    """One case, one trainer (torchtitan 0.3.0 builds its meshes once a process: a second Trainer in the
    same process fails in `fully_shard`, so each launch runs one)."""
    from automicro.testing.faults import FaultInjector
    from automicro.torchtitan import _torchtitan_internals as internals

    internals.use_cpu()
    assets = os.path.join(folder, "assets")
    global_batch = ["--training.global_batch_size", str(BATCH * world_size)]
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.folder", "ckpt"]
    try:
        if case == "search":
            # Only rank 1 runs out (above 4 samples a microbatch) while searching; then an OOM on it in backward
            # at batch 4, after the hooks came off (stable_batches 2: hooks off from batch 3). torchtitan's DCP
            # checkpoints at steps 3 and 6 (the search's state in its train_state); torchtitan's validation at
            # steps 1 and 6 (a validation guards the batches after it with the hooks on again).
            validation = ["--validator.enable", "--validator.freq", "6", "--validator.steps", "2",
                          "--validator.dataloader.dataset", "c4_test", "--validator.dataloader.dataset_path",
                          os.path.join(assets, "data")]
            return _auto(argv(assets, os.path.join(folder, "search"), 6, *global_batch, *ckpt, *validation),
                         (FaultInjector("forward", ranks=[1], above=4),
                          FaultInjector("backward", ranks=[1], batch=4, times=1)), stable_batches=2)
        if case == "reference":
            return _fixed(argv(assets, os.path.join(folder, "reference"), 6), 4)
        if case == "resumed":
            # A new job on the search's folder, resumed from its step-3 checkpoint, to step 6.
            return _auto(argv(assets, os.path.join(folder, "search"), 6, *global_batch, *ckpt, "--checkpoint.load_step", "3"),
                         (FaultInjector("forward", ranks=[1], above=4),), stable_batches=2)
        if case in ("moe_search", "moe_reference"):
            # torchtitan's routed debug model (DeepSeek-V3's blocks: 8 experts, 3 a token, 2 shared; its MoE counts
            # the tokens each expert got in every training forward, and the optimizer step's pre-hook moves the
            # expert bias by them). Only rank 1 runs out above 4 while searching; after the hooks came off, an OOM
            # in backward at batch 4 on rank 1, after that microbatch's forward counted its tokens.
            args = argv(assets, os.path.join(folder, case), 6, *global_batch, module="deepseek_v3")
            if case == "moe_reference":
                return _fixed(args, 4)
            return _auto(args, (FaultInjector("forward", ranks=[1], above=4),
                                FaultInjector("backward", ranks=[1], batch=4, times=1)), stable_batches=2)
        compiled = ["--compile.enable", "--compile.backend", "aot_eager"]  # torchtitan's block and loss compile
        if case == "one_rank":
            args = argv(assets, os.path.join(folder, "one"), 3, "--training.global_batch_size", "3", *compiled)
            return _auto(args, (FaultInjector("forward", above=1),), stable_batches=1)
        if case == "one_rank_reference":
            args = argv(assets, os.path.join(folder, "one_ref"), 3, "--training.global_batch_size", "3", *compiled)
            return _fixed(args, 1)
    except Exception as error:  # noqa: BLE001 - the test prints it
        return {"error": _error(error)}
    raise ValueError(case)


def max_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def describe(out: Optional[dict[str, Any]]) -> str:
    if isinstance(out, dict) and "error" in out:
        return out["error"]["traceback"]
    return ""
