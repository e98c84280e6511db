"""Every private name of torchtitan that `automicro.torchtitan` touches, in one place.

Checked against torchtitan 0.3.0 (the registry's newest; it needs torch >= 2.12: it imports
``torch.distributed.fsdp.DataParallelMeshDims``, which torch 2.11 lacks). Each helper says what it
reaches into; `check_version` refuses another torchtitan with what to install.

CPU ranks (no CUDA device: CI's machines, a laptop). torchtitan picks its device once at import
(``torchtitan.tools.utils.device_type``: "cuda" where no accelerator is found) and trains language
models through FlexAttention, which has no backward on CPU. `use_cpu` points torchtitan's modules at
the CPU (a device module with the few calls torchtitan makes), runs FlexAttention's call as an eager
``scaled_dot_product_attention`` under the same block mask (the mask made dense: the same numbers,
slower), and, on gloo, has FSDP2 reduce gradients with SUM (gloo has no PREMUL_SUM; torchtitan's
gradient divide factor is 1, so SUM is the same reduction). Nothing changes where a GPU is present.
"""

from __future__ import annotations

import importlib
import types
from typing import Any, Optional

import torch

SUPPORTED = ("0.3.0",)

# torchtitan modules that bind `device_type` / `device_module` at import (0.3.0).
_DEVICE_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.tools.profiler",
    "torchtitan.models.common.token_dispatcher",
)


def version() -> str:
    import torchtitan

    return str(getattr(torchtitan, "__version__", "unknown"))


def check_version() -> None:
    found = version()
    if found not in SUPPORTED:
        raise RuntimeError(
            f"automicro.torchtitan: torchtitan {found} is installed; automicro supports torchtitan {', '.join(SUPPORTED)} "
            f"(pip install torchtitan=={SUPPORTED[-1]}, on torch >= 2.12)"
        )


class _CpuProperties:
    name = "cpu"
    total_memory = 1 << 40  # torchtitan's memory monitor divides by it; automicro's figures come from its own source


def _cpu_device_module() -> types.SimpleNamespace:
    """What torchtitan 0.3.0 calls on its device module (`torch.cuda` on a GPU), answered for the CPU."""
    return types.SimpleNamespace(
        set_device=lambda device=None: None,
        device_count=lambda: 1,
        current_device=lambda: 0,
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: _CpuProperties(),
        reset_peak_memory_stats=lambda device=None: None,
        empty_cache=lambda: None,
        memory_stats=lambda device=None: {},
        synchronize=lambda device=None: None,
        is_available=lambda: True,
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
    )


def _eager_flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, score_mod: Any = None, block_mask: Any = None,
    scale: Optional[float] = None, enable_gqa: bool = False, return_aux: Any = None, kernel_options: Any = None,
) -> tuple[torch.Tensor, Any]:
    """FlexAttention's call (``FlexAttention._compiled_flex_attn``) on CPU: SDPA under the dense form
    of the same block mask."""
    from torch.nn.attention.flex_attention import create_mask

    if score_mod is not None or (return_aux is not None and getattr(return_aux, "lse", False)):
        raise NotImplementedError(
            "automicro.torchtitan on CPU: attention with a score_mod or a log-sum-exp output needs FlexAttention on a GPU"
        )
    mask = None
    if block_mask is not None:
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out, None


def cpu_wanted() -> bool:
    """torchtitan would train on a device that is not there: no CUDA (nor other accelerator)."""
    from torchtitan.tools import utils

    return utils.device_type == "cuda" and not torch.cuda.is_available()


def use_cpu() -> None:
    """Point torchtitan 0.3.0 at the CPU (see the module's docstring). Idempotent."""
    module = _cpu_device_module()
    for name in _DEVICE_MODULES:
        loaded = importlib.import_module(name)
        if hasattr(loaded, "device_type"):
            loaded.device_type = "cpu"
        if hasattr(loaded, "device_module"):
            loaded.device_module = module
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention._compiled_flex_attn = staticmethod(_eager_flex_attention)


def sum_reduction_on_gloo(model_parts: list[torch.nn.Module]) -> None:
    """On gloo, FSDP2 reduces with SUM where torchtitan's divide factor 1 would ask for PREMUL_SUM."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def build_validator(trainer: Any, local_batch_size: int) -> Any:
    """torchtitan 0.3.0's validator, built as its `Trainer.__init__` builds it (no pipeline: refused
    under `auto`), at `local_batch_size`."""
    config = trainer.config
    batch_degree, batch_rank = batch_mesh(trainer)
    return config.validator.build(
        parallelism=config.parallelism,
        dp_world_size=batch_degree,
        dp_rank=batch_rank,
        tokenizer=trainer.tokenizer,
        parallel_dims=trainer.parallel_dims,
        loss_fn=trainer.loss_fn,
        validation_context=trainer.train_context,
        metrics_processor=trainer.metrics_processor,
        seq_len=config.training.seq_len,
        local_batch_size=local_batch_size,
        pp_schedule=None,
        pp_has_first_stage=None,
        pp_has_last_stage=None,
    )


def batch_mesh(trainer: Any) -> tuple[int, int]:
    """(data-parallel degree, this rank's place in it), as torchtitan's `Trainer.__init__` reads them."""
    dims = trainer.parallel_dims
    if not dims.dp_enabled:
        return 1, 0
    mesh = dims.get_mesh("batch")
    return mesh.size(), mesh.get_local_rank()


def converters(model_config: Any) -> list[str]:
    """The names of the model converters (float8, MXFP8, NVFP4 ...) applied to a model config."""
    from torchtitan.components.quantization.utils import has_quantization

    return ["quantization"] if has_quantization(model_config) else []
