"""`torch.compile` with the engine: one validated `CompileConfig` and how a model is compiled.

YAML: a top-level ``compile:`` section (``true`` for the defaults, ``null`` / ``false`` for eager,
or a mapping of the keys below); Python: ``automicro.Trainer(compile=...)`` with the same values.

Two scopes:
- ``blocks`` (default): each block the engine shards (each `fully_shard` unit) gets its
  ``forward`` compiled in place, before sharding, as torchtitan does. FSDP2's hooks and automicro's
  sync hooks stay eager around the compiled code (they sit on the module's call, not in its
  forward), so every fault site and consensus point is where it is without compile, parameter
  names do not change (checkpoints load either way), and the blocks share one graph.
- ``model``: Composer's own whole-model ``compile_config`` (`torch.compile` of the model's forward,
  FSDP2's hooks traced where dynamo can).

Recompilation under the search: every size the search visits is a new batch dimension. With
``dynamic: null`` (default) dynamo compiles the first size static and, at the second size it
sees, recompiles once with that dimension dynamic; further sizes reuse it. ``dynamic: true``
compiles dynamic from the start (one compile, maybe slower kernels); ``dynamic: false`` compiles
once per size (bounded by dynamo's cache limit, after which it runs eager: not advised with
``auto``). `compiled_graphs()` counts the graphs compiled so far in the process.

Owns: the ``compile`` keys and their checks, compiling blocks in place, the arguments handed to
Composer. May not touch: Composer (the Trainer hands ``compile_config`` over), the search.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Optional

SCOPES = ("blocks", "model")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_KEY = "compile"


class CompileConfigError(ValueError):
    """A bad ``compile`` value; the message names the key and what is allowed."""


@dataclass(frozen=True)
class CompileConfig:
    """How the model is compiled.

    Attributes:
        scope: ``blocks`` (each sharded block's forward, the default) or ``model`` (Composer's
            whole-model compile).
        mode: `torch.compile`'s mode: None (its default), ``default``, ``reduce-overhead``,
            ``max-autotune`` or ``max-autotune-no-cudagraphs``.
        dynamic: `torch.compile`'s ``dynamic``: None (static first, dynamic after a second size),
            true or false.
        fullgraph: refuse graph breaks (`torch.compile`'s ``fullgraph``).
        backend: the compiler backend (``inductor``; ``aot_eager`` runs the traced graph without
            generated kernels: what CPU tests use).
    """

    scope: str = "blocks"
    mode: Optional[str] = None
    dynamic: Optional[bool] = None
    fullgraph: bool = False
    backend: str = "inductor"

    def __post_init__(self) -> None:
        key = COMPILE_KEY
        if self.scope not in SCOPES:
            raise CompileConfigError(f"{key}.scope={self.scope!r}: must be one of {', '.join(SCOPES)}")
        if self.mode is not None and self.mode not in MODES:
            raise CompileConfigError(f"{key}.mode={self.mode!r}: must be null or one of {', '.join(MODES)}")
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise CompileConfigError(f"{key}.dynamic={self.dynamic!r}: must be null, true or false")
        if not isinstance(self.fullgraph, bool):
            raise CompileConfigError(f"{key}.fullgraph={self.fullgraph!r}: must be true or false")
        if not isinstance(self.backend, str) or not self.backend:
            raise CompileConfigError(f"{key}.backend={self.backend!r}: must be a backend name (inductor, aot_eager, ...)")

    @classmethod
    def from_value(cls, value: Any, key: str = COMPILE_KEY) -> Optional["CompileConfig"]:
        """``null`` / ``false``: None (eager); ``true`` / ``{}``: the defaults; a mapping: its keys;
        a `CompileConfig`: itself."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise CompileConfigError(f"{key}={value!r}: must be true, false, null or a mapping of {', '.join(_names())}")
        for name in value:
            if name not in _names():
                close = difflib.get_close_matches(str(name), _names(), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise CompileConfigError(f"{key}.{name}={value[name]!r}: unknown key{hint}; allowed: {', '.join(_names())}")
        try:
            return cls(**dict(value))
        except CompileConfigError as error:
            raise CompileConfigError(str(error).replace(f"{COMPILE_KEY}.", f"{key}.", 1)) from None

    def torch_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `torch.compile` (and of Composer's ``compile_config``)."""
        kwargs: dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if self.mode is not None:
            kwargs["mode"] = self.mode
        return kwargs

    def describe(self) -> str:
        return f"compile: {self.scope}, backend {self.backend}, mode {self.mode or 'default'}, dynamic {self.dynamic}"


def _names() -> list[str]:
    return [f.name for f in fields(CompileConfig)]


class CompiledBlocks:
    """The blocks whose ``forward`` `compile_blocks` compiled, and how to compile them again.

    `recompile(dynamic)` drops every graph dynamo compiled in the process (`torch.compiler.reset`:
    the blocks share one code object, so a graph compiled dynamic would otherwise still serve the
    new wrappers) and compiles each block's eager ``forward`` again with ``dynamic`` (False: a
    static graph per shape; True: one dynamic graph; None: torch's automatic dynamic). Other
    compiled code of the process (a model's own, transformers' flex attention) compiles again at
    its next call. `dynamic` is what the blocks are compiled with now."""

    def __init__(self, blocks: list[Any], config: CompileConfig) -> None:
        import torch

        self.blocks, self.config = blocks, config
        self._eager = [block.forward for block in blocks]
        self.dynamic = config.dynamic
        for block, eager in zip(blocks, self._eager):
            block.forward = torch.compile(eager, **config.torch_kwargs())

    def recompile(self, dynamic: Optional[bool]) -> None:
        import torch

        torch.compiler.reset()
        kwargs = {**self.config.torch_kwargs(), "dynamic": dynamic}
        for block, eager in zip(self.blocks, self._eager):
            block.forward = torch.compile(eager, **kwargs)
        self.dynamic = dynamic


def compile_blocks(blocks: Iterable[Any], config: CompileConfig) -> CompiledBlocks:
    """Compile each block's ``forward`` in place (before `fully_shard`)."""
    return CompiledBlocks(list(blocks), config)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (first compiles and recompiles)."""
    from automicro.engine import _torch_internals as internals

    return internals.compiled_graph_count()


__all__ = ["CompileConfig", "CompileConfigError", "CompiledBlocks", "SCOPES", "MODES", "compile_blocks", "compiled_graphs"]
