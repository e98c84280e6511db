import torch
from composer.core import Callback
from automicro.integration.builders import MemoryCapCallback

class PeakProbe(Callback):
    def __init__(self, capcb): self.capcb=capcb; self.rows=[]
    def batch_start(self, state, logger): self.capcb.cap.reset_peak(); self.r0=self.capcb.cap.stats()["num_alloc_retries"]
    def batch_end(self, state, logger):
        s=self.capcb.cap.stats(); self.rows.append((int(state.timestamp.batch), s["peak_bytes"], s["live_bytes"], s["num_alloc_retries"]-self.r0))

def peaks(rank, world):
    torch.set_num_threads(1)
    from tests import automicro_cases as c
    out={}
    for m in range(1, 9):
        capcb=MemoryCapCallback(limit_bytes=10**9)
        probe=PeakProbe(capcb)
        t=c.build_trainer(world, 4, microbatch=m, callbacks=(capcb, probe))
        t.fit(); t.close()
        out[m]=probe.rows
    return out

def _peaks_with(world, width, opt, sizes=range(1,9), batches=3):
    import automicro
    from tests import automicro_cases as c
    from tests.toy_models import ComposerStack
    out={}
    for m in sizes:
        capcb=MemoryCapCallback(limit_bytes=10**9)
        probe=PeakProbe(capcb)
        torch.manual_seed(0)
        model=ComposerStack(width=width)
        o = torch.optim.AdamW(model.parameters(), lr=1e-2) if opt=="adamw" else torch.optim.SGD(model.parameters(), lr=1e-2)
        t=automicro.Trainer(model=model, train_dataloader=c.make_loader(world, batches), max_duration=f"{batches}ba", optimizers=o,
            device="cpu", parallelism_config={"fsdp2": {}}, device_train_microbatch_size=m, callbacks=[capcb, probe], loggers=[], progress_bar=False, log_to_console=False, seed=1)
        t.fit(); t.close()
        out[(width,opt,m)]=[r[1] for r in probe.rows]
    return out

def peaks2(rank, world):
    torch.set_num_threads(1)
    out={}
    for width, opt in [(16,"sgd"), (4,"adamw"), (8, "adamw"), (64, "adamw")]:
        out.update(_peaks_with(world, width, opt))
    return out

def peaks3(rank, world):
    torch.set_num_threads(1)
    return _peaks_with(world, 4, "adamw", batches=3)

def ckpt(rank, world, folder="/tmp/am_ckpt"):
    torch.set_num_threads(1)
    import os, traceback
    from tests import automicro_cases as c
    from tests.toy_models import full_state
    from automicro.integration.callback import AutoMicrobatching
    from automicro.testing.faults import FaultInjector
    out = {}
    auto=AutoMicrobatching(log_attempts=False)
    t=c.build_trainer(world, 4, callbacks=(auto, FaultInjector("backward_pre", above=5)), loader_batches=8, save_folder=folder, save_interval="4ba")
    t.fit()
    out["a_hist"]=[(r.batch, r.size, r.outcome) for r in auto.history]
    out["a_params"]=float(sum(v.abs().sum() for v in full_state(t.state.model).values()))
    t.close()
    torch.distributed.barrier()
    out["files"]=sorted(os.listdir(folder)) if os.path.isdir(folder) else None
    try:
        auto2=AutoMicrobatching(log_attempts=False)
        probe=c.Probe()
        inj=FaultInjector("backward_pre", above=5)
        t2=c.build_trainer(world, 8, callbacks=(auto2, inj, probe), save_folder=None, load_path=os.path.join(folder, "ep0-ba4-rank0.pt"))
        t2.fit()
        out["b_hist"]=[(r.batch, r.size, r.split, r.outcome, r.note) for r in auto2.history]
        out["b_rows"]=sorted({(r["batch"], r["hooks_active"], r["module_hooks"]) for r in probe.rows})
        out["fired"]=inj.fired
        out["b_params"]=full_state(t2.state.model)
        out["steps"]=c.adam_steps(t2)
        t2.close()
    except Exception:
        out["error"]=traceback.format_exc()
    # uninterrupted
    auto3=AutoMicrobatching(log_attempts=False)
    t3=c.build_trainer(world, 8, callbacks=(auto3, FaultInjector("backward_pre", above=5)))
    t3.fit()
    if "b_params" in out:
        out["vs_uninterrupted"]=c.max_error(out.pop("b_params"), full_state(t3.state.model))
    t3.close()
    return out
