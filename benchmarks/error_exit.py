"""What a non-OOM error inside the first attempt does on a GPU with compile (inductor).
MODE=inject: a RuntimeError after the first forward of batch 0; MODE=killworker: the inductor compile
workers are killed while the first compile runs. Prints a timeline; time the launcher from outside:

    for v in "inject unshard" "inject keep" "killworker unshard"; do set -- $v
      MODE=$1 PIN=$2 timeout 200 composer -n 1 benchmarks/error_exit.py; done
"""
import faulthandler, os, sys, threading, time, traceback
faulthandler.dump_traceback_later(int(os.environ.get("DUMP_AFTER", "100")), repeat=False)
sys.path.insert(0, os.getcwd())
T0 = time.time()
def say(*a):
    print(f"[t={time.time()-T0:6.1f}s]", *a, flush=True)
import torch
import automicro
from automicro.composer.callback import AutoMicrobatching
from composer.core import Callback
from composer.models import HuggingFaceModel
from composer.optim import DecoupledAdamW
from transformers import LlamaConfig, LlamaForCausalLM
from torch.utils.data import DataLoader

class Boom(Callback):
    def after_forward(self, state, logger):
        if int(state.timestamp.batch) == 0:
            say("raising the injected error")
            raise RuntimeError("injected non-OOM error after the forward")

def killer():
    import psutil
    me = psutil.Process()
    while True:
        kids = [p for p in me.children(recursive=True) if "compile_worker" in " ".join(p.cmdline())]
        if kids:
            time.sleep(float(os.environ.get("KILL_DELAY", "2")))
            for p in me.children(recursive=True):
                if "compile_worker" in " ".join(p.cmdline()):
                    say("killing compile worker", p.pid); p.kill()
            return
        time.sleep(0.2)

def main():
    mode = os.environ.get("MODE", "inject")
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)
    model = HuggingFaceModel(LlamaForCausalLM(cfg), tokenizer=None, use_logits=True)
    batch, n = 8, 3
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": t, "labels": t.clone()} for t in torch.randint(0, 32000, (batch * n, 1024), generator=g)]
    collate = lambda rows: {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    if mode == "killworker":
        threading.Thread(target=killer, daemon=True).start()
    trainer = automicro.Trainer(
        model=model, train_dataloader=DataLoader(data, batch_size=batch, collate_fn=collate), max_duration=f"{n}ba",
        optimizers=DecoupledAdamW(model.parameters(), lr=1e-4), precision="amp_bf16",
        parallelism_config={"fsdp2": {"mixed_precision": "DEFAULT", "on_one_rank": os.environ.get("PIN", "unshard")}},
        device_train_microbatch_size="auto", compile=True,
        callbacks=[AutoMicrobatching()] + ([Boom()] if mode == "inject" else []), progress_bar=False, log_to_console=False, loggers=[],
    )
    say("fit")
    try:
        trainer.fit()
    except BaseException as e:
        say("FIT RAISED", type(e).__name__, str(e)[:300])
        raise
    say("DONE")

if __name__ == "__main__":
    main()
