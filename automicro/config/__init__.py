"""Typed run configuration: an omegaconf YAML file plus CLI overrides onto validated dataclasses.

    from automicro.config import load_config, parse_cli
    yaml_path, overrides = parse_cli(sys.argv[1:])
    cfg = load_config(yaml_path, overrides)      # TrainConfig, fully validated

Everything here runs before any process group starts and fails with a `ConfigError` whose
message names the full dotted key, the bad value and what is allowed, e.g.::

    device_train_microbatch_size='big': must be a positive int or 'auto'

In parts, lowest first (each module's docstring says what it owns and may not touch):
- `registry`: the callback names a config may use, ``name -> "module:attribute"`` (no imports);
- `convert`: `ConfigError` and the generic typed conversion of a plain tree onto dataclasses;
- `schema`: the dataclasses (`TrainConfig` and its sections), their field checks, and the checks
  shared with `automicro.Trainer` (`check_microbatch_size`, `auto_eval_problem`);
- `load`: YAML file, ``key=value`` overrides, interpolation: `load_config`, `from_dict`, `parse_cli`;
- `environment`: `check_environment(cfg, world_size)`, what only the launch can tell (CUDA present,
  folders writable, sizes against the world size).
The ``parallelism_config.fsdp2`` section is `automicro.engine.FSDP2Config`, checked by the engine.
This package imports neither Composer nor the trainer at import time.
"""

from automicro.config.convert import ConfigError
from automicro.config.environment import check_environment
from automicro.config.load import USAGE, from_dict, load_config, parse_cli, resolve_config, shipped_configs
from automicro.config.registry import CALLBACK_REGISTRY, KNOWN_CALLBACKS
from automicro.config.schema import (
    AUTO,
    DATA_KINDS,
    DEVICES,
    INIT_DEVICES,
    MODEL_PRESETS,
    OPTIMIZERS,
    PRECISIONS,
    SCHEDULERS,
    DataConfig,
    LoggerConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    SchedulerConfig,
    TrainConfig,
    auto_eval_problem,
    check_microbatch_size,
    load_path_problem,
    sharded_checkpoint_problem,
)
from automicro.engine.config import CHECKPOINT_FORMATS, PARALLELISM_KEYS, SAVE_FAILURES

__all__ = [
    "AUTO",
    "CALLBACK_REGISTRY",
    "CHECKPOINT_FORMATS",
    "SAVE_FAILURES",
    "ConfigError",
    "DATA_KINDS",
    "DEVICES",
    "DataConfig",
    "INIT_DEVICES",
    "KNOWN_CALLBACKS",
    "LoggerConfig",
    "MODEL_PRESETS",
    "ModelConfig",
    "OPTIMIZERS",
    "OptimizerConfig",
    "PARALLELISM_KEYS",
    "PRECISIONS",
    "ParallelismConfig",
    "SCHEDULERS",
    "SchedulerConfig",
    "TrainConfig",
    "USAGE",
    "auto_eval_problem",
    "check_environment",
    "check_microbatch_size",
    "from_dict",
    "load_path_problem",
    "sharded_checkpoint_problem",
    "load_config",
    "resolve_config",
    "shipped_configs",
    "parse_cli",
]
