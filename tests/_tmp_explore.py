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
