"""The main job: train a Llama-style decoder with Composer, FSDP2 and (optionally) auto microbatching.

    python -m automicro.train tiny-cpu [key=value ...]                      # one process
    composer -n 2 -m automicro.train tiny-cpu [key=value ...]               # N processes
    python -m automicro.train --check my-config.yaml [key=value ...]        # check only, no run
    WORLD_SIZE=16 python -m automicro.train --check ...                     # ... for a world size
    automicro-train tiny-cpu [key=value ...]                                # the console script

CONFIG is a YAML path, or the name of a config shipped with the package (`configs/`:
tiny-cpu, tiny-cpu-varlen, tiny-cpu-pp, tiny-gpu; `automicro.config.shipped_configs()`). From a clone,
`scripts/train.py` runs this module.

The config (keys, values, `load_path`, `device`, FSDP2 with `auto`) is checked before any model,
process group or launch-wide work: under a launcher, one `config error:` line per node (its local
rank 0), the other ranks leave quietly. `--check` runs the same checks alone, in one process,
before a launch.
"""

from __future__ import annotations

import os
import pickle
import sys
import time

from automicro.config import ConfigError, check_environment, load_config, parse_cli


def _config_error(error: BaseException) -> int:
    print(f"config error: {error}", file=sys.stderr)
    return 2


def _early_config_error(error: BaseException) -> int:
    """A config error found before any process group: every rank of a node found the same one, so
    the node's local rank 0 says it once and fails the launch; the others leave quietly (exit 0),
    which a launcher (composer, torchrun) waits for instead of killing local rank 0 mid-message."""
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return 0
    return _config_error(error)


def main(argv: list[str]) -> int:
    check_only = bool(argv) and argv[0] == "--check"
    if check_only:
        argv = argv[1:]
    try:
        path, overrides = parse_cli(argv)
        cfg = load_config(path, overrides)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        per_rank_batch = cfg.per_rank_batch_size(world_size)
        check_environment(cfg, world_size)
    except ConfigError as error:
        return _early_config_error(error)
    if check_only:
        print(
            f"[automicro] config ok: {path} with {len(overrides)} override(s), world size {world_size}, "
            f"per-rank batch {per_rank_batch}, microbatch {cfg.device_train_microbatch_size}"
        )
        return 0

    from automicro.engine import ensure_record_stream_free

    ensure_record_stream_free()  # before Composer creates any process group

    from composer.core import Evaluator
    from composer.utils import dist, reproducibility

    from automicro import AutoMicrobatching, Trainer
    from automicro.engine.config import FSDP2ConfigError
    from automicro.composer import builders
    from automicro.composer.loggers import build_loggers, output_lines
    from automicro.core import exit_watch

    try:
        callbacks = builders.build_callbacks(cfg)
        loggers = build_loggers(cfg)
        reproducibility.seed_all(cfg.seed)
        model = builders.build_model_from(cfg)
        dataset = builders.build_dataset(cfg, model.model.config.vocab_size)
        train_dl = builders.train_data(cfg, builders.build_train_dataloader(cfg, dataset, per_rank_batch))
    except ConfigError as error:
        return _config_error(error)
    eval_dataloader = None
    if cfg.eval_interval is not None:
        eval_microbatch = cfg.device_eval_microbatch_size
        eval_dataloader = Evaluator(
            label="eval",
            dataloader=builders.build_dataloader(
                dataset, per_rank_batch, shuffle=False, drop_last=True, collate_fn=builders.collate_for(cfg)
            ),
            subset_num_batches=cfg.eval_subset_num_batches,
            device_eval_microbatch_size=eval_microbatch,
        )

    optimizer = builders.build_optimizer(cfg, model)
    parallelism = None if cfg.fsdp2 is None else {"fsdp2": cfg.fsdp2}
    if cfg.pipeline is not None:
        parallelism = {**(parallelism or {}), "pipeline": cfg.pipeline}
    try:
        trainer = Trainer(
            model=model,
            train_dataloader=train_dl,
            eval_dataloader=eval_dataloader,
            eval_interval=cfg.eval_interval or 1,
            max_duration=cfg.max_duration,
            optimizers=optimizer,
            schedulers=builders.build_scheduler(cfg),
            device=cfg.device,
            precision=cfg.precision,
            device_train_microbatch_size=cfg.device_train_microbatch_size,
            parallelism_config=parallelism,
            callbacks=callbacks,
            loggers=loggers,
            seed=cfg.seed,
            run_name=cfg.run_name,
            save_folder=cfg.save_folder,
            save_interval=cfg.save_interval,
            load_path=cfg.load_path,
            autoresume=cfg.autoresume,
            checkpoint_format=cfg.checkpoint_format,
            save_failure=cfg.save_failure,
            compile=cfg.compile,
            dist_timeout=cfg.dist_timeout,
            progress_bar=False,
        )
    except (ConfigError, FSDP2ConfigError) as error:  # what the engine checks when it shards
        return _config_error(error)
    except (pickle.UnpicklingError, EOFError) as error:
        if cfg.load_path is None:
            raise
        return _config_error(
            f"load_path={cfg.load_path!r}: cannot be read as a Composer checkpoint ({type(error).__name__}: {error}); "
            "point load_path at a checkpoint a save wrote, or set load_path to null"
        )
    started = time.perf_counter()
    trainer.fit()
    seconds = time.perf_counter() - started

    if dist.get_global_rank() == 0:
        batches = int(trainer.state.timestamp.batch)
        tokens = int(trainer.state.timestamp.token)
        loss = trainer.state.total_loss_dict.get("loss/train/total", float("nan"))
        print(
            f"[automicro] done: {batches} batches, final loss {loss:.4f}, "
            f"{tokens / seconds:,.0f} tokens/s over the whole fit ({seconds:.1f} s, {world_size} rank(s))"
        )
        auto = next((c for c in trainer.state.callbacks if isinstance(c, AutoMicrobatching)), None)
        if cfg.compile is not None:
            from automicro.engine.compile import compiled_graphs

            compiled = getattr(trainer.sharded_model, "compiled", None) if hasattr(trainer, "sharded_model") else None
            scope = compiled.scope if compiled is not None else cfg.compile.scope or "model"  # unset, no blocks: model
            graphs = compiled_graphs()
            why = ""
            if not graphs and "memory_cap" in (cfg.callbacks or {}):
                from automicro.engine._torch_internals import COMPILES_UNDER_DISPATCH_MODES

                if not COMPILES_UNDER_DISPATCH_MODES:  # torch 2.7: dynamo skips under the cap's dispatch mode
                    import torch

                    why = f" (torch {torch.__version__} does not compile under callbacks.memory_cap: the model ran eager; torch 2.11+ does)"
            print(f"[automicro] {cfg.compile.describe(scope)}: {graphs} graph(s) compiled on rank 0{why}")
        found = None if auto is None else auto.summary_line(per_rank_batch)
        if found is not None:
            print(found)
        elif cfg.device_train_microbatch_size != "auto":
            print(f"[automicro] fixed microbatch size {cfg.device_train_microbatch_size}")
        for line in output_lines(cfg, loggers):
            print(line, flush=True)
    trainer.close()
    # The run finished: what holds the exit after it is bounded (torch inductor's compile workers after a cold start).
    auto = next((c for c in trainer.state.callbacks if isinstance(c, AutoMicrobatching)), None)
    exit_watch.arm_finished(auto.settings.exit_timeout_s if auto is not None else exit_watch.DEFAULT_TIMEOUT_S, dist.get_global_rank())
    return 0


def cli() -> None:
    """The `automicro-train` console script."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
