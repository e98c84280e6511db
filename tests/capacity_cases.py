"""Multi-rank cases for a card that is not all ours: what a failed attempt leaves behind.
(A capacity read wrong and a limit that moves run with the probe's cases, `optimizer_cases.shared_card`.)"""

from __future__ import annotations

from typing import Any

import torch


# ---- a failed attempt leaves nothing behind --------------------------------------------------

LEFT_BEHIND_SITES = ("forward_pre", "forward", "backward_pre", "backward", "unshard_alloc", "reduce_scatter_alloc", "loss", "optimizer_step")
LAYOUTS = {
    "default": ({}, None),
    "both trades": ({}, ["grad_sync_once", "no_reshard"]),
    "checkpointing": ({"activation_checkpointing": True}, None),
}


def left_behind(rank: int, world: int) -> dict[str, Any]:
    """Every site, with the sync hooks on (searching: sizes above 5 run out) and off (one OOM at
    batch 3, the rerun of a size that ran clean), under the engine's layouts: what each failed
    attempt left allocated after its wipe, counted by the memory cap (live tensor bytes)."""
    import automicro
    from automicro.testing import FaultInjector, MemoryCapCallback
    from tests.automicro_cases import make_loader
    from tests.toy_models import ComposerStack

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    cases = [("default", site, "searching") for site in LEFT_BEHIND_SITES]
    cases += [("both trades", site, "searching") for site in ("forward", "backward", "reduce_scatter_alloc")]
    cases += [("checkpointing", site, "searching") for site in ("forward", "backward")]
    cases += [("default", site, "steady") for site in ("forward", "backward", "reduce_scatter_alloc")]
    cases += [("both trades", "backward", "steady"), ("checkpointing", "backward", "steady")]
    for layout, site, when in cases:
        fsdp2, trades = LAYOUTS[layout]
        torch.manual_seed(0)
        model = ComposerStack(width=16)
        # Steady: the hooks come off after one clean batch; the OOM is at batch 3, hooks off.
        auto = automicro.AutoMicrobatching(log_attempts=False, layout=trades or "fixed", stable_batches=1)
        injector = FaultInjector(site, above=5) if when == "searching" else FaultInjector(site, batch=3, times=1)
        batches = 1 if when == "searching" else 4
        trainer = automicro.Trainer(
            model=model, train_dataloader=make_loader(world, batches), max_duration=f"{batches}ba",
            optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2), device="cpu",
            parallelism_config={"fsdp2": dict(fsdp2)}, device_train_microbatch_size="auto",
            callbacks=[auto, injector, MemoryCapCallback(limit_bytes=10**12, retry_band=0.0)],
            loggers=[], progress_bar=False, log_to_console=False, seed=17,
        )
        try:
            trainer.fit()
            out[f"{layout}/{site}/{when}"] = {
                "ooms": auto.ooms_total, "left_behind": auto.left_behind_bytes, "fired": injector.fired,
                "left_behind_exact": auto.left_behind_exact, "checked": auto.left_behind_checked,
                "hooks_at_failures": [r.hooks for r in auto.history if r.outcome == "oom"],
            }
        except Exception as error:  # noqa: BLE001 - the test says which case broke
            out[f"{layout}/{site}/{when}"] = {"crash": f"{type(error).__name__}: {error}"}
        finally:
            trainer.close()
    return out
