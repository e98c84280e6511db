"""The host offload switched on between batches, on one GPU (a device-tool command):

    OUT=... python3 benchmarks/offload_check.py [--steps 6] [--at 3]

A model of residual MLP blocks and a head (hidden 1,024, 6 blocks: about 25M parameters), fp32, sharded by automicro's
engine on one CUDA rank (NCCL), trained `--steps` steps of two microbatches: without the offload (`engine`), built with
it (`built`: ``cpu_offload: true``, FSDP2's ``CPUOffloadPolicy`` with pinned memory) and switched on before step
`--at` (`switched`: `automicro.engine.offload.offload_to_host`), with torch's AdamW and Composer's DecoupledAdamW (the
local step). Prints and writes OUT/offload_check.json: every parameter's largest gap between the runs (fp32), where the
parameters and the optimizer state live after the switch (device, pinned), the device memory allocated before and after
it, what it moved and how long it took. The CPU test (tests/test_offload.py) checks the same on gloo ranks, where the
host is the device; this is the run where bytes move.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

HIDDEN, BLOCKS = 1024, 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(HIDDEN, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train(mode: str, optimizer_name: str, steps: int, at: int) -> dict[str, Any]:
    from automicro.engine import FSDP2Config, local_step, shard
    from automicro.engine.offload import is_offloaded, offload_to_host

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = Net()
    sharded = shard(model, FSDP2Config(wrap=["Block"], cpu_offload=mode == "built"), device=device)
    if optimizer_name == "decoupled_adamw":
        from composer.optim import DecoupledAdamW

        optimizer = DecoupledAdamW(model.parameters(), lr=1e-3, weight_decay=1e-5)
        local_step.install(optimizer, None)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    out: dict[str, Any] = {"step_s": []}
    for step in range(steps):
        if mode == "switched" and step == at:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            started = time.perf_counter()
            moved = offload_to_host(sharded, [optimizer])
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            torch.cuda.empty_cache()
            locals_ = [p.to_local() for p in model.parameters()]
            states = [getattr(v, "_local_tensor", v) for s in optimizer.state.values() for v in s.values()
                      if torch.is_tensor(v) and v.dim() > 0]
            out["switch"] = {
                "seconds": round(seconds, 4), "param_bytes": moved.param_bytes, "state_bytes": moved.state_bytes,
                "allocated_before_mib": round(before / 2**20, 1), "allocated_after_mib": round(torch.cuda.memory_allocated() / 2**20, 1),
                "params_on": sorted({t.device.type for t in locals_}), "params_pinned": all(t.is_pinned() for t in locals_),
                "params_device_attr": sorted({p.device.type for p in model.parameters()}),
                "states_on": sorted({t.device.type for t in states}), "offloaded": is_offloaded(sharded),
            }
        torch.manual_seed(100 + step)
        x = torch.randn(8, 256, HIDDEN, device=device)
        y = torch.randint(0, 512, (8, 256), device=device)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for half in (slice(0, 4), slice(4, 8)):
            nn.functional.cross_entropy(model(x[half]).flatten(0, 1), y[half].flatten()).div(2).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        out["step_s"].append(round(time.perf_counter() - started, 4))
    out["params"] = [p.full_tensor().detach().float().cpu() for p in model.parameters()]
    out["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--at", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    result: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    for name in ("adamw", "decoupled_adamw"):
        runs = {mode: train(mode, name, args.steps, args.at) for mode in ("engine", "built", "switched")}
        gap = lambda a, b: max(float((x - y).abs().max()) for x, y in zip(runs[a]["params"], runs[b]["params"]))  # noqa: E731
        result[name] = {
            "switched_vs_built": gap("switched", "built"), "switched_vs_engine": gap("switched", "engine"),
            "built_vs_engine": gap("built", "engine"), "switch": runs["switched"]["switch"],
            "step_s": {m: runs[m]["step_s"] for m in runs}, "peak_mib": {m: runs[m]["peak_mib"] for m in runs},
        }
        print(f"[offload_check] {name}: switched-built {result[name]['switched_vs_built']:.3g}, switched-engine "
              f"{result[name]['switched_vs_engine']:.3g}, built-engine {result[name]['built_vs_engine']:.3g}; "
              f"switch {json.dumps(runs['switched']['switch'])}; steps {json.dumps(result[name]['step_s'])}", flush=True)
        with open(os.path.join(os.environ.get("OUT", "."), "offload_check.json"), "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
