"""The vocabulary head alone on one GPU: the fused backends against the plain head, loss, gradients, time, memory.

    python benchmarks/head_check.py --out $OUT        # a device-tool command (CUDA)

For each shape (rows = microbatch x sequence, the hidden size, the vocabulary; the dtype) and each head (plain: the
logits, their fp32 upcast and the cross-entropy, as transformers computes them; `torch`: automicro's torch-native
chunked path; `liger`: liger-kernel's fused linear cross-entropy), with soft-capping where the shape asks: the loss
and both gradients against the plain head's (relative: the largest difference over the largest value), the median
forward-and-backward time over 5 runs after 2 warm-ups (CUDA events), and the peak memory it added above its inputs.
Writes `head_check.json` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from automicro.engine.head import choose_backend, fused_linear_cross_entropy, plain_linear_cross_entropy  # noqa: E402

# (name, rows, hidden, vocabulary, dtype, softcap)
SHAPES = (
    ("fp32 32k", 2048, 512, 32000, torch.float32, None),
    ("gemma3-1b 262k x 8", 8 * 2048, 1152, 262144, torch.bfloat16, None),
    ("gemma2-2b 256k x 4, softcap 30", 4 * 2048, 2304, 256000, torch.bfloat16, 30.0),
    ("llama3.2-1b 128k x 16", 16 * 2048, 2048, 128256, torch.bfloat16, None),
    ("tinyllama 32k x 16", 16 * 2048, 2048, 32000, torch.bfloat16, None),
)


def run(head: str, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, softcap: Any) -> tuple[Any, ...]:
    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    if head == "plain":
        loss = plain_linear_cross_entropy(h, w, labels, softcap=softcap)
    else:
        loss = fused_linear_cross_entropy(h, w, labels, softcap=softcap, backend=head)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def timed(fn: Callable[[], Any], repeats: int = 5) -> tuple[float, int]:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), torch.cuda.max_memory_allocated() - base


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/head_check"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    backend, why = choose_backend(device, torch.bfloat16)
    print(f"[head_check] liger: {backend == 'liger'} {why}", flush=True)
    rows_out = []
    for name, rows, hidden_size, vocab, dtype, softcap in SHAPES:
        torch.manual_seed(0)
        hidden = torch.randn(rows, hidden_size, device=device, dtype=dtype)
        weight = torch.randn(vocab, hidden_size, device=device, dtype=dtype) * hidden_size ** -0.5
        labels = torch.randint(0, vocab, (rows,), device=device)
        labels[::7] = -100
        reference = run("plain", hidden, weight, labels, softcap)
        for head in ("plain", "torch", "liger") if backend == "liger" else ("plain", "torch"):
            got = run(head, hidden, weight, labels, softcap)
            seconds, peak = timed(lambda: run(head, hidden, weight, labels, softcap))
            row = {"shape": name, "head": head, "loss": float(got[0]), "loss_rel": abs(float(got[0]) - float(reference[0])) / abs(float(reference[0])),
                   "grad_hidden_rel": rel(got[1], reference[1]), "grad_weight_rel": rel(got[2], reference[2]),
                   "seconds": seconds, "peak_gib": peak / 2**30}
            rows_out.append(row)
            print(f"[head_check] | {name:32s} {head:6s} loss {row['loss']:.5f} (rel {row['loss_rel']:.1e}) grads rel "
                  f"{row['grad_hidden_rel']:.1e} / {row['grad_weight_rel']:.1e}  {1e3 * seconds:8.2f} ms  +{row['peak_gib']:.2f} GiB",
                  flush=True)
            with open(os.path.join(args.out, "head_check.json"), "w", encoding="utf-8") as handle:
                json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": rows_out}, handle, indent=1)
        del hidden, weight, labels, reference
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
