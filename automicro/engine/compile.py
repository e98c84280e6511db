"""`torch.compile` with the engine: one validated `CompileConfig` and how a model is compiled.

YAML: a top-level ``compile:`` section (``true`` for the defaults, ``null`` / ``false`` for eager,
or a mapping of the keys below); Python: ``automicro.Trainer(compile=...)`` with the same values.

Two scopes, and the default that measures them:
- unset (``scope: null``, the default): the blocks are compiled, and under ``auto`` the whole model
  is timed against them once their graphs settle; the faster stays (`automicro.batch.compile_scope`).
  Without FSDP2 (nothing sharded into blocks) it is ``model``.
- ``blocks``: each block the engine shards (each `fully_shard` unit) gets its
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
``auto``). `compiled_graphs()` counts the graphs compiled so far in the process, `graph_breaks()` why dynamo broke
one (`automicro.batch.compile_watch` says both once the run trains).

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
        scope: None (the default: the blocks, with the whole model timed against them under
            ``auto``), ``blocks`` (each sharded block's forward) or ``model`` (the whole model's
            forward, Composer's ``compile_config``).
        mode: `torch.compile`'s mode: None (its default), ``default``, ``reduce-overhead``,
            ``max-autotune`` or ``max-autotune-no-cudagraphs``.
        dynamic: `torch.compile`'s ``dynamic``: None (static first, dynamic after a second size),
            true or false.
        fullgraph: refuse graph breaks (`torch.compile`'s ``fullgraph``).
        backend: the compiler backend (``inductor``; ``aot_eager`` runs the traced graph without
            generated kernels: what CPU tests use).
    """

    scope: Optional[str] = None
    mode: Optional[str] = None
    dynamic: Optional[bool] = None
    fullgraph: bool = False
    backend: str = "inductor"

    def __post_init__(self) -> None:
        key = COMPILE_KEY
        if self.scope is not None and self.scope not in SCOPES:
            raise CompileConfigError(f"{key}.scope={self.scope!r}: must be null (measured) or one of {', '.join(SCOPES)}")
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

    @property
    def compiles_blocks(self) -> bool:
        """The engine compiles each sharded block (``blocks``, and unset before a trial says otherwise)."""
        return self.scope != "model"

    @property
    def measures_scope(self) -> bool:
        return self.scope is None

    def describe(self, scope: Optional[str] = None) -> str:
        """`scope`: the one in use where it was measured."""
        return f"compile: {scope or self.scope or 'blocks'}, backend {self.backend}, mode {self.mode or 'default'}, dynamic {self.dynamic}"


def _names() -> list[str]:
    return [f.name for f in fields(CompileConfig)]


class CompiledBlocks:
    """The blocks whose ``forward`` `compile_blocks` compiled, and how to compile them again.

    `recompile(dynamic, batch_dynamic)` drops every graph dynamo compiled in the process
    (`torch.compiler.reset`: the blocks share one code object, so a graph compiled before would
    otherwise still serve the new wrappers) and compiles each block's eager ``forward`` again with
    ``dynamic`` (False: a static graph per shape; True: one graph dynamic in every dimension; None:
    torch's automatic dynamic). ``batch_dynamic`` marks the batch dimension of each call's
    batch-sized inputs dynamic before the compiled forward (with ``dynamic`` None: the graph the
    search leaves, dynamic in the batch and static elsewhere, compiled at the size of its next
    call). `compile_model()` compiles the root's ``forward`` instead (every block eager again: the
    ``model`` scope, as Composer's ``compile_config`` does it; dynamic as the config says);
    `back_to_blocks` returns to the blocks' compiled forwards (their graphs kept: nothing compiles again);
    `recompile` compiles the blocks anew. Other compiled code of the process (a model's own,
    transformers' flex attention) compiles again at its next call. `scope`, `dynamic` and
    `batch_dynamic` say how the model is compiled now."""

    def __init__(self, blocks: list[Any], config: CompileConfig, root: Any = None) -> None:
        self.blocks, self.config, self.root = blocks, config, root
        self._eager = [block.forward for block in blocks]
        self._root_forward: Any = None  # the root's own `forward` entry, if it had one, under `model`
        self._blocks_form: tuple[list[Any], Optional[bool], bool] = ([], None, False)  # the blocks before `compile_model`
        self.dynamic, self.batch_dynamic, self.scope = config.dynamic, False, "blocks"
        # The blocks (by index) whose forward is compiled with the ``op`` recompute inside (`set_selective`), and each
        # block's compiled forwards of the current compile, plain and selective (the other kept for a switch back).
        self.selective: set[int] = set()
        self._forms: dict[tuple[int, bool], Any] = {}
        self._compile(config.dynamic, False)

    @property
    def has_other_scope(self) -> bool:
        """A root other than the blocks (a model whose only unit is its root has one scope)."""
        return self.root is not None and all(block is not self.root for block in self.blocks)

    def recompile(self, dynamic: Optional[bool], batch_dynamic: bool = False) -> None:
        _reset()
        self._eager_root()
        self._compile(dynamic, batch_dynamic)

    def compile_model(self) -> None:
        """The whole model's forward compiled, every block eager again. Nothing is dropped: the blocks' graphs
        stay in dynamo's cache, so `back_to_blocks` returns to them without compiling."""
        import torch

        assert self.has_other_scope
        self._blocks_form = ([block.forward for block in self.blocks], self.dynamic, self.batch_dynamic)
        for block, eager in zip(self.blocks, self._eager):
            block.forward = eager
        self._root_forward = self.root.__dict__.get("forward", _NONE)
        self.root.forward = torch.compile(self.root.forward, **self.config.torch_kwargs())
        self.scope, self.dynamic, self.batch_dynamic = "model", self.config.dynamic, False

    def back_to_blocks(self) -> None:
        """Undo `compile_model`: the root eager, each block's compiled forward as it was (its graphs kept)."""
        _, dynamic, batch_dynamic = self._blocks_form
        self._eager_root()
        self.scope, self.dynamic, self.batch_dynamic = "blocks", dynamic, batch_dynamic
        for index, block in enumerate(self.blocks):
            block.forward = self._form(index, index in self.selective)  # the forms compiled before: kept

    def _eager_root(self) -> None:
        if self._root_forward is None:
            return
        if self._root_forward is _NONE:
            del self.root.forward
        else:
            self.root.forward = self._root_forward
        self._root_forward = None

    def _compile(self, dynamic: Optional[bool], batch_dynamic: bool) -> None:
        self._forms = {}
        self.dynamic, self.batch_dynamic, self.scope = dynamic, batch_dynamic, "blocks"
        for index, block in enumerate(self.blocks):
            block.forward = self._form(index, index in self.selective)

    def _form(self, index: int, selective: bool) -> Any:
        """Block `index`'s compiled forward of the current compile (plain, or with the ``op`` recompute inside),
        made at its first use: dynamo compiles it at its first call."""
        import torch

        from automicro.engine.recompute import selective as checkpointed

        key = (index, selective)
        if key not in self._forms:
            eager = self._eager[index]
            kwargs = {**self.config.torch_kwargs(), "dynamic": self.dynamic}
            compiled = torch.compile(checkpointed(eager) if selective else eager, **kwargs)
            self._forms[key] = _batch_dynamic(compiled) if self.batch_dynamic else compiled
        return self._forms[key]

    def set_selective(self, indices: set[int]) -> None:
        """The blocks `indices` compiled with the ``op`` recompute inside their graph, the others plain
        (`automicro.engine.recompute.BlockDial`; between batches). A form used before is reused: nothing compiles
        again. Under the ``model`` scope the blocks are eager: nothing to swap (kept for `back_to_blocks`)."""
        indices = set(indices)
        if indices == self.selective:
            return
        self.selective = indices
        if self.scope != "blocks":
            return  # the blocks run eager inside the whole model's graph: `back_to_blocks` puts their forms back
        for index, block in enumerate(self.blocks):
            block.forward = self._form(index, index in indices)


_NONE = object()  # the root had no `forward` of its own (its class's)


def _batch_dynamic(compiled: Any) -> Any:
    import functools

    from automicro.engine import _torch_internals as internals

    @functools.wraps(compiled)
    def forward(*args: Any, **kwargs: Any) -> Any:
        internals.mark_batch_dynamic(args, kwargs)
        return compiled(*args, **kwargs)

    return forward


def compile_blocks(blocks: Iterable[Any], config: CompileConfig, root: Any = None) -> CompiledBlocks:
    """Compile each block's ``forward`` in place (before `fully_shard`); `root`: the model whose
    ``forward`` the ``model`` scope compiles instead."""
    return CompiledBlocks(list(blocks), config, root)


def _reset() -> None:
    """`torch.compiler.reset`: every graph dropped (dynamo's counters, `compiled_graphs`, go on)."""
    import torch

    torch.compiler.reset()


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (first compiles and recompiles)."""
    from automicro.engine import _torch_internals as internals

    return internals.compiled_graph_count()


def graph_breaks() -> dict[str, int]:
    """Why dynamo broke a graph (or a backend gave one up) in this process so far, by reason, and how often."""
    from automicro.engine import _torch_internals as internals

    return internals.graph_breaks()


def compile_seconds() -> list[float]:
    """The seconds each graph dynamo compiled in this process took (its own timings; empty where not kept)."""
    from automicro.engine import _torch_internals as internals

    return internals.compile_seconds()


__all__ = ["CompileConfig", "CompileConfigError", "CompiledBlocks", "SCOPES", "MODES", "compile_blocks", "compile_seconds",
           "compiled_graphs", "graph_breaks"]
