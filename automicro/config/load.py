"""Loading a run configuration: YAML file + ``key=value`` overrides -> a validated `TrainConfig`.

    from automicro.config import load_config, parse_cli
    yaml_path, overrides = parse_cli(sys.argv[1:])
    cfg = load_config(yaml_path, overrides)      # TrainConfig, fully validated

Loading order: dataclass defaults <- YAML file <- ``key=value`` overrides (YAML-typed values,
dotted keys), then omegaconf interpolations (``${run_name}``, ``${oc.env:HOME}``) are resolved
on the merged tree (so defaults such as ``run_dir: runs/${run_name}`` see the final values), and
the plain tree is converted by `automicro.config.convert` onto `automicro.config.schema` (not by
omegaconf's structured configs, whose errors are cryptic).

Owns: reading files, the command line and override syntax, merging, interpolation. May not
touch: the trainer, builders, Composer, process groups (everything here runs before any exists);
values are checked by the schema, not here (an override key is walked along the schema only to
name a typo at once). omegaconf / yaml are imported inside the functions that use them.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any, Sequence, Union

from automicro.config.convert import ConfigError, _build, _did_you_mean, _hints, _is_optional
from automicro.config.schema import TrainConfig
from automicro.engine.config import FSDP2Config

USAGE = (
    "usage: python -m automicro.train [--check] CONFIG [key=value ...] "
    "(CONFIG: a .yaml / .yml path, or the name of a config shipped with automicro)"
)
# The configs shipped with the package (`python -m automicro.train tiny-cpu`). One copy lives in the repository's
# top-level `configs/`; the wheel carries it as `automicro/configs/` (setup.py's package_dir mapping). So an
# installed wheel finds them beside the package, a clone (an editable install, `scripts/train.py`) one level up.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CANDIDATE_DIRS = (os.path.join(_PACKAGE_DIR, "configs"), os.path.join(os.path.dirname(_PACKAGE_DIR), "configs"))


def configs_dir() -> str:
    """The folder of the shipped configs: the wheel's `automicro/configs/`, else a clone's `configs/` ("" if neither)."""
    for folder in _CANDIDATE_DIRS:
        if os.path.isfile(os.path.join(folder, "tiny-cpu.yaml")):
            return folder
    return ""


def shipped_configs() -> list[str]:
    """The names `python -m automicro.train NAME` takes: the YAMLs in `configs_dir()`."""
    folder = configs_dir()
    if not folder:
        return []
    return sorted(name[: -len(".yaml")] for name in os.listdir(folder) if name.endswith(".yaml"))


def resolve_config(name_or_path: str) -> str:
    """A .yaml / .yml path as given; a name of a shipped config (`tiny-cpu`) as its file's path."""
    if name_or_path.endswith((".yaml", ".yml")):
        return name_or_path
    names = shipped_configs()
    if name_or_path in names:
        return os.path.join(configs_dir(), f"{name_or_path}.yaml")
    hint = _did_you_mean(name_or_path, names)
    raise ConfigError(
        f"first argument {name_or_path!r} is neither a .yaml / .yml config file nor a config shipped with automicro "
        f"({', '.join(names) or 'none found'}){hint}; {USAGE}"
    )

_OVERRIDE_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")


def _defaults_tree(cls: type) -> dict[str, Any]:
    """The dataclass defaults as a plain tree (the base the YAML is merged onto)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            continue
        if dataclasses.is_dataclass(default):
            default = _defaults_tree(type(default))
        out[f.name] = default
    return out


def _deep_merge(base: Any, update: Any) -> Any:
    """Mapping onto mapping merges key by key; anything else replaces."""
    if isinstance(base, Mapping) and isinstance(update, Mapping):
        out = dict(base)
        for k, v in update.items():
            out[k] = _deep_merge(out[k], v) if k in out else v
        return out
    return update


def _split_override(item: Any) -> tuple[str, str]:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"override {item!r}: must be key=value (dotted key, YAML value); {USAGE}")
    key, value = item.split("=", 1)
    key = key.strip()
    if not _OVERRIDE_KEY_RE.match(key):
        raise ConfigError(
            f"override {item!r}: bad key {key!r}; keys are dotted names such as model.overrides.n_layers; {USAGE}"
        )
    return key, value


def _check_override_key(key: str, item: str) -> None:
    """Walk the dataclass schema along ``key``; stop at the first free-form (non-dataclass) field."""
    cls: Any = TrainConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        _, inner = _is_optional(cls)
        if not dataclasses.is_dataclass(inner):
            return
        fields = {f.name: f for f in dataclasses.fields(inner)}
        if part not in fields and hasattr(inner, "_fold_extra"):
            return  # e.g. model.n_layers: a LlamaConfig field, checked when the tree is built
        if inner is FSDP2Config:
            return  # the engine checks its own section (keys and values) when the tree is built
        if part not in fields:
            here = ".".join(parts[:i]) or "top level"
            raise ConfigError(
                f"override {item!r}: unknown key {key!r}{_did_you_mean(part, fields)}; "
                f"allowed keys at {here}: {', '.join(fields)}"
            )
        cls = _hints(inner)[part]


def _parse_override(item: str) -> dict[str, Any]:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    key, value = _split_override(item)
    _check_override_key(key, item)
    try:
        tree = OmegaConf.to_container(OmegaConf.from_dotlist([f"{key}={value}"]), resolve=False)
    except (OmegaConfBaseException, ValueError) as e:  # yaml.YAMLError is not a ValueError
        raise ConfigError(f"override {item!r}: cannot parse the value: {_one_line(e)}") from e
    except Exception as e:
        raise ConfigError(f"override {item!r}: cannot parse the value: {_one_line(e)}") from e
    return tree


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _read_yaml(path: str) -> Any:
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not os.path.exists(path):
        raise ConfigError(f"config file {path!r}: not found")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r}: not a file")
    try:
        conf = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path!r}: invalid YAML: {e}") from e
    except (OmegaConfBaseException, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"config file {path!r}: cannot load: {e}") from e
    tree = OmegaConf.to_container(conf, resolve=False)
    if tree is None:
        return {}
    if not isinstance(tree, Mapping):
        raise ConfigError(f"config file {path!r}: the top level must be a mapping of settings, got {tree!r}")
    return tree


def _resolve(tree: dict[str, Any], where: str) -> dict[str, Any]:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(OmegaConf.create(tree), resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: cannot resolve interpolations: {_one_line(e)}") from e


def load_config(path: Union[str, os.PathLike], overrides: Sequence[str] = ()) -> TrainConfig:
    """Read ``path`` (YAML), apply ``key=value`` overrides, resolve interpolations, validate.

    Raises:
        ConfigError: on a missing file, bad YAML, a bad override, an unknown key, a wrong type
            or an out-of-range value; the message names the dotted key and the value.
    """
    path = os.fspath(path)
    if isinstance(overrides, str):
        overrides = [overrides]
    tree = _deep_merge(_defaults_tree(TrainConfig), _read_yaml(path))
    for item in overrides:
        tree = _deep_merge(tree, _parse_override(item))
    return _build(TrainConfig, _resolve(tree, f"config file {path!r}"), "")


def from_dict(values: Mapping[str, Any]) -> TrainConfig:
    """Validate a plain nested dict (e.g. `TrainConfig.to_dict()`'s output): defaults are merged
    under it and interpolations resolved exactly as for a YAML file."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"config={values!r}: must be a mapping of settings")
    tree = _deep_merge(_defaults_tree(TrainConfig), dict(values))
    return _build(TrainConfig, _resolve(tree, "config"), "")


def parse_cli(argv: Sequence[str]) -> tuple[str, list[str]]:
    """``sys.argv[1:]`` -> (yaml_path, overrides); ``CONFIG [key=value ...]`` (CONFIG: a YAML path or a
    shipped config's name, `resolve_config`)."""
    argv = list(argv)
    if not argv:
        raise ConfigError(f"missing the config file; {USAGE}")
    path, rest = argv[0], argv[1:]
    if path in ("-h", "--help") or path.startswith("-") or "=" in path:
        raise ConfigError(f"first argument {path!r} must be the config YAML path; {USAGE}")
    path = resolve_config(path)
    for item in rest:
        if item.startswith("-"):
            raise ConfigError(f"argument {item!r}: options are not supported, only key=value overrides; {USAGE}")
        _split_override(item)
    return path, rest
