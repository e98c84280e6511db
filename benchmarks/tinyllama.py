"""One model on one GPU: transformers `LlamaForCausalLM` in TinyLlama's shape (every other config
value at its default, `use_cache` included) in Composer's `HuggingFaceModel`, seq 2048, per-rank batch
32, amp_bf16, Composer's DecoupledAdamW, synthetic tokens, `compile: true`; each batch's time (device
synchronized at batch start and end) and the peak reserved memory, as JSON under $OUT and one
`RESULT` line. Not on the shared harness: a one-model probe (`benchmarks/RESULTS.md` 2026-11-29, the compiled TinyLlama row); `benchmarks/one_gpu.py` is
the harness's one-GPU suite.

    PIN=keep MB=auto BATCHES=58 composer -n 1 benchmarks/tinyllama.py   # automicro auto, FSDP2
    PIN=unshard MB=32 BATCHES=9 composer -n 1 benchmarks/tinyllama.py   # unsharded, whole model compiled
    PIN=keep MB=16 DYN=1 BATCHES=8 composer -n 1 benchmarks/tinyllama.py  # fixed 16, compile dynamic: true

ENV: PIN keep|unshard (`parallelism_config.fsdp2.on_one_rank`), MB auto|N, BATCHES, LAYOUT (a
comma list of trades to pin with `auto`), DYN=1 (`compile: {dynamic: true}`).
"""
import os, sys, time, json
sys.path.insert(0, os.getcwd())
import torch
import automicro
from automicro.composer.callback import AutoMicrobatching
from composer.core import Callback
from composer.models import HuggingFaceModel
from composer.optim import DecoupledAdamW
from transformers import LlamaConfig, LlamaForCausalLM
from torch.utils.data import DataLoader

class Clock(Callback):
    def __init__(self): self.t = []; self.last = None
    def batch_start(self, state, logger):
        torch.cuda.synchronize(); self.last = time.perf_counter()
    def batch_end(self, state, logger):
        torch.cuda.synchronize(); self.t.append(time.perf_counter() - self.last)

def main():
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)
    model = HuggingFaceModel(LlamaForCausalLM(cfg), tokenizer=None, use_logits=True)
    batch, n = 32, int(os.environ.get("BATCHES", "10"))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": t, "labels": t.clone()} for t in torch.randint(0, 32000, (batch * n, 2048), generator=g)]
    collate = lambda rows: {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    pin, mb = os.environ.get("PIN", "keep"), os.environ.get("MB", "auto")
    mb = mb if mb == "auto" else int(mb)
    clock = Clock()
    extra = os.environ.get("LAYOUT")
    cbs = [clock] + ([AutoMicrobatching(**({"layout": extra.split(",")} if extra else {}))] if mb == "auto" or extra else [])
    trainer = automicro.Trainer(
        model=model, train_dataloader=DataLoader(data, batch_size=batch, collate_fn=collate), max_duration=f"{n}ba",
        optimizers=DecoupledAdamW(model.parameters(), lr=1e-4), precision="amp_bf16",
        parallelism_config={"fsdp2": {"mixed_precision": "DEFAULT", "on_one_rank": pin}},
        device_train_microbatch_size=mb, compile={"dynamic": True} if os.environ.get("DYN") else True, callbacks=cbs, progress_bar=False, log_to_console=False, loggers=[],
    )
    err = None
    try:
        trainer.fit()
    except Exception as e:
        err = f"{type(e).__name__}: {str(e)[:200]}"
    t = clock.t
    steady = sorted(t[3:]) if len(t) > 4 else t
    med = steady[len(steady) // 2] if steady else None
    out = {"pin": pin, "mb": mb, "layout": extra, "times": [round(x, 4) for x in t], "median_after_3": med,
           "tokens_per_s": None if not med else round(batch * 2048 / med), "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 1),
           "error": err}
    print("RESULT", json.dumps(out), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"tiny-{pin}-{mb}-{extra}-{os.environ.get('DYN')}.json"), "w") as f:
        json.dump(out, f)
    os._exit(0)

if __name__ == "__main__":
    main()
