"""One-rank cases for the measured choice between FSDP2 and the model unsharded (`automicro.batch.
sharding_choice`, `automicro.engine.twin`), on one gloo rank in fp32: each returns plain data for
tests/test_sharding_choice.py; a case that breaks is {"crash": ...}."""

from __future__ import annotations

import traceback
import warnings
from typing import Any, Optional

import torch
from composer.core import Callback

import automicro
from automicro.composer.callback import AutoMicrobatching
from tests.automicro_cases import SEED, make_loader
from automicro.batch.batch_profile import BatchProfile
from tests.timings import arm_seconds
from tests.toy_models import ComposerStack, full_state, max_error

# Settled at batch 0 (the whole batch fits), hooks off after 3 clean batches, one batch at the settled
# size, the twin's first batch (5), 3 batches each way: decided after batch 11; 5 more through the kept arm.
BATCHES = 17
SLOW_FSDP2_S = 0.2  # the slow path's sleep at every FSDP2 block's forward (3 blocks)


class SlowArm(Callback):
    """Makes one arm of the choice slower (`ShardingChoice.timing`): `slow` maps "unsharded" or "sharded" to a factor;
    every batch of an arm takes 1 s times its factor, whatever was measured (`tests/timings.py`)."""

    def __init__(self, auto: AutoMicrobatching, slow: dict[str, float]) -> None:
        self.auto, self.slow = auto, slow

    def run_event(self, event: Any, state: Any, logger: Any) -> None:
        choice = self.auto.search.sharding_choice
        if choice is not None:
            choice.timing = arm_seconds(self.slow)


class PlanSeams(Callback):
    """The trial plan's test seams, set once the plan exists (the first batch makes it): `profile` is every batch
    profile's figures (what the machine measured replaced: `TrialPlan.measured`), `slow_scope` maps "model" or
    "blocks" to a factor on the compile scope trial's batch times; `graphs` records dynamo's graph count after
    every batch (`automicro.engine.compile.compiled_graphs`)."""

    def __init__(self, auto: AutoMicrobatching, profile: Any = None, slow_scope: Optional[dict[str, float]] = None) -> None:
        self.auto, self.profile, self.slow_scope = auto, profile, slow_scope
        self.graphs: dict[int, int] = {}

    def run_event(self, event: Any, state: Any, logger: Any) -> None:
        from automicro.engine.compile import compiled_graphs

        plan = self.auto.search.plan
        if plan is not None and self.profile is not None:
            plan.measured = lambda measured: self.profile
        scope = self.auto.search.compile_scope
        if scope is not None and self.slow_scope:
            scope.timing = arm_seconds(self.slow_scope)
        if str(event) in ("Event.BATCH_END", "batch_end"):
            self.graphs[int(state.timestamp.batch) - 1] = compiled_graphs()


class SlowFSDP2Path(Callback):
    """A slow path in FSDP2 alone: `seconds` of sleep at every forward of an FSDP2 block (a forward pre-hook on
    the sharded model's blocks, inside a range named as FSDP2's own are; the twin's modules are copies without it).
    The batch profile measures it as the device idle under FSDP2's host code (`automicro.batch.batch_profile`), what
    the model unsharded is expected to win (`automicro.batch.trial_price`)."""

    def __init__(self, auto: AutoMicrobatching, seconds: float) -> None:
        self.auto, self.seconds, self.hooked = auto, seconds, False

    def fit_start(self, state: Any, logger: Any) -> None:
        import time

        sharded = self.auto.runtime.sharded
        for module in sharded.fsdp_modules:
            if module is not sharded.module:
                module.register_forward_pre_hook(lambda *_: self._sleep(time))
                self.hooked = True


    def _sleep(self, time: Any) -> None:
        with torch.profiler.record_function("FSDP::slow_path"):
            time.sleep(self.seconds)


class StopAfter(Callback):
    """Stops the run after `batches` batches of a longer `max_duration` (the run the trials are priced against)."""

    def __init__(self, batches: int) -> None:
        self.batches = batches

    def batch_end(self, state: Any, logger: Any) -> None:
        if int(state.timestamp.batch) >= self.batches:
            state.stop_training()


class Through(Callback):
    """Records, at every forward, whether it ran through the twin; with `oom_at` (a batch index), the
    first forward through the twin at or after that batch runs out of memory."""

    def __init__(self, auto: AutoMicrobatching, oom_at: Optional[int] = None, error: Any = False,
                 retries_from: Optional[int] = None, retries_in: tuple[int, ...] = ()) -> None:
        self.auto, self.oom_at, self.error, self.retries_from = auto, oom_at, error, retries_from
        self.retries_in = retries_in  # batches whose every forward, through either, makes retries
        self.batches: dict[int, bool] = {}
        self.fired = 0
        self.retries = 0  # allocator retries made up in forwards through the twin from batch `retries_from` on

    def before_forward(self, state: Any, logger: Any) -> None:
        twin = getattr(self.auto.runtime.sharded, "twin", None)
        through = twin is not None and state.model is twin.module
        batch = int(state.timestamp.batch)
        self.batches[batch] = through
        if through and self.retries_from is not None and batch >= self.retries_from:
            self.retries += 1
        if batch in self.retries_in:
            self.retries += 1
        if self.error == "everywhere" and self.oom_at is not None and batch >= self.oom_at:
            self.fired += 1
            raise ValueError("test: a bug in the model's forward, through either")
        if through and self.oom_at is not None and batch >= self.oom_at and not self.fired:
            self.fired += 1
            if self.error:
                raise ValueError("test: the whole-model compile failed, through the unsharded twin")
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate (test: through the unsharded twin)")


def _toy(on_one_rank: Optional[str], slow: Optional[dict[str, float]] = None, oom_at: Optional[int] = None,
         retries_from: Optional[int] = None, retries_in: tuple[int, ...] = (),
         microbatch: Any = "auto", compile: Any = None, batches: int = BATCHES, data_batches: Optional[int] = None,
         profile: Any = None, slow_scope: Optional[dict[str, float]] = None, slow_fsdp2_s: float = 0.0,
         bound: bool = False, planned: Optional[int] = None, **more: Any) -> dict[str, Any]:
    """`batches` trained, of `data_batches` (default: as many) in the loader; `bound`: the trials priced (the runs that
    test a trial's own logic run it unpriced), against a run of `planned` batches (stopped after `batches`)."""
    torch.manual_seed(0)
    model = ComposerStack()
    lines: list[str] = []
    auto = AutoMicrobatching(log_attempts=False, thrash_batches=2, bound_trials=bound) if microbatch == "auto" else None
    callbacks: list[Any] = []
    through = seams = None
    if auto is not None:
        through = Through(auto, oom_at, retries_from=retries_from, retries_in=retries_in)
        seams = PlanSeams(auto, profile, slow_scope)
        callbacks = [auto, through, seams] + ([SlowArm(auto, slow)] if slow else [])
        callbacks += [SlowFSDP2Path(auto, slow_fsdp2_s)] if slow_fsdp2_s else []
        callbacks += [StopAfter(batches)] if planned else []
    fsdp2: dict[str, Any] = {} if on_one_rank is None else {"on_one_rank": on_one_rank}
    if compile is not None:
        torch.compiler.reset()
    trainer = automicro.Trainer(
        model=model, train_dataloader=make_loader(1, data_batches or batches), max_duration=f"{planned or batches}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2), device="cpu", parallelism_config={"fsdp2": fsdp2},
        device_train_microbatch_size=microbatch, callbacks=callbacks, loggers=[], progress_bar=False,
        log_to_console=False, seed=SEED, compile=compile, **more,
    )
    if auto is not None:
        auto.runtime.info = lambda message: lines.append(message)  # type: ignore[method-assign]
    if retries_from is not None or retries_in:  # the allocator's retry count, as the batches made it grow
        assert auto is not None and through is not None
        memory, counted = auto.runtime.memory, auto.runtime.memory.alloc_retries
        memory.alloc_retries = lambda: counted() + through.retries  # type: ignore[method-assign]
    try:
        trainer.fit()
        choice = None if auto is None else auto.search.sharding_choice
        twin = None if trainer.sharded_model is None else trainer.sharded_model.twin
        return {
            "state": None if choice is None else choice.state,
            "twin": twin is not None,
            "twin_compiled": twin is not None and twin.compiled,
            "twin_scope": None if twin is None else twin.scope,
            "lines": [line for line in lines if line.startswith("one rank:")],
            "scope_lines": [line for line in lines if line.startswith("compile:")],
            "plan_lines": [line for line in lines if line.startswith(("trials:", "a batch profiled"))],
            "graphs": {} if seams is None else seams.graphs,
            "history": [] if auto is None else [(r.batch, r.size, r.outcome, r.note) for r in auto.history],
            "through": {} if through is None else through.batches,
            "fired": 0 if through is None else through.fired,
            "split": None if auto is None else list(auto.policy.current_split()),
            "summary": None if auto is None else auto.search.summary_line(),
            "params": full_state(trainer.state.model),
        }
    finally:
        trainer.close()


def toy_cases(rank: int, world: int) -> dict[str, Any]:
    """The toy stack: the twin made faster (kept), slower (not kept), out of memory while timed and
    while kept, under compile (aot_eager); each against FSDP2 at the same split and the unsharded pin."""
    out: dict[str, Any] = {}
    runs = {
        "faster": dict(on_one_rank="auto", slow={"sharded": 3.0}),
        "slower": dict(on_one_rank="auto", slow={"unsharded": 3.0}),
        "oom_trial": dict(on_one_rank="auto", slow={"sharded": 3.0}, oom_at=0),
        "oom_kept": dict(on_one_rank="auto", slow={"sharded": 3.0}, oom_at=15),
        "thrash_kept": dict(on_one_rank="auto", slow={"sharded": 3.0}, retries_from=14),
        # Retries in the twin's first batch (4) and FSDP2's after it (5), as one H100 showed on a routed model.
        "thrash_trial": dict(on_one_rank="auto", slow={"sharded": 3.0}, retries_in=(4, 5)),
        "default_cpu": dict(on_one_rank=None),
        "compiled": dict(on_one_rank="auto", slow={"sharded": 3.0}, compile={"backend": "aot_eager", "scope": "blocks", "dynamic": False}),
        # Priced, over a run of 1,000 batches: a profile that leaves the model unsharded too little to win: not timed,
        # FSDP2 kept (one line names its price).
        "priced_out": dict(on_one_rank="auto", profile=BatchProfile(1.0, 0.002, 0.003, 0.0, 0.2, device="cpu"), bound=True,
                           planned=1000),
        # Priced: a slow path in FSDP2 alone (200 ms at every block's forward, in FSDP2's ranges): measured as the device
        # idle under FSDP2's host code, the twin priced to win it, timed and kept. Real time, on purpose (what the
        # profiler measures is the point): the sleeps are 20 times the toy's operators on a quiet machine, so the
        # verdict holds with the operators 10 times slower (a loaded CI machine ran them 9 times slower).
        "slow_fsdp2": dict(on_one_rank="auto", slow_fsdp2_s=SLOW_FSDP2_S, bound=True, planned=1000),
        # Compile with the scope left to measure: the twin kept (FSDP2 made slower), then the whole model timed for
        # the twin against its blocks' times from the one-rank trial (the whole model made slower: not kept). Not
        # bounded (a 40-batch run cannot pay a compile: the plan would rule the scope trial out).
        "scope_after_twin": dict(on_one_rank="auto", slow={"sharded": 3.0}, slow_scope={"model": 3.0},
                                 compile={"backend": "aot_eager"}, batches=32, bound=False),
    }
    for name, kwargs in runs.items():
        try:
            out[name] = _toy(**kwargs)
        except Exception:
            out[name] = {"crash": traceback.format_exc()}
    try:
        split = out["faster"]["split"]
        references: dict[int, tuple[Any, Any]] = {}  # by the batches a run trained
        for name in runs:
            if "params" in out[name]:
                batches = runs[name].get("batches", BATCHES)
                if batches not in references:
                    references[batches] = (_toy("keep", microbatch=max(split), batches=batches)["params"],
                                           _toy("unshard", microbatch=max(split), batches=batches)["params"])
                fixed, pinned = references[batches]
                params = out[name].pop("params")
                out[name]["error_fsdp2"] = max_error(params, fixed)
                out[name]["error_unsharded"] = max_error(params, pinned)
    except Exception:
        out["reference"] = {"crash": traceback.format_exc()}
    return out


def _hf(family: str, on_one_rank: str, slow: Optional[dict[str, float]], microbatch: Any) -> dict[str, Any]:
    """A transformers model built from its config at the defaults (GPT-2 ties its head to the embedding)."""
    from composer.models import HuggingFaceModel
    from composer.utils import dist as composer_dist
    import transformers

    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=2, n_positions=32)
        net = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        net = transformers.LlamaForCausalLM(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = HuggingFaceModel(net, tokenizer=None, use_logits=True)
    generator = torch.Generator().manual_seed(5)
    rows = [{"input_ids": t, "labels": t.clone()} for t in torch.randint(0, 96, (4 * BATCHES, 16), generator=generator)]
    loader = torch.utils.data.DataLoader(rows, batch_size=4, sampler=composer_dist.get_sampler(rows, shuffle=False),
                                         collate_fn=lambda b: {k: torch.stack([r[k] for r in b]) for k in b[0]})
    auto = AutoMicrobatching(log_attempts=False, bound_trials=False) if microbatch == "auto" else None
    callbacks: list[Any] = [] if auto is None else [auto, SlowArm(auto, slow or {})]
    lines: list[str] = []
    trainer = automicro.Trainer(
        model=model, train_dataloader=loader, max_duration=f"{BATCHES}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3), device="cpu",
        parallelism_config={"fsdp2": {"on_one_rank": on_one_rank}}, device_train_microbatch_size=microbatch,
        callbacks=callbacks, loggers=[], progress_bar=False, log_to_console=False, seed=SEED,
    )
    if auto is not None:
        auto.runtime.info = lambda message: lines.append(message)  # type: ignore[method-assign]
    try:
        trainer.fit()
        return {
            "state": None if auto is None else auto.search.sharding_choice.state,
            "lines": [line for line in lines if line.startswith("one rank:")],
            "split": None if auto is None else list(auto.policy.current_split()),
            "tied": family == "gpt2" and net.lm_head.weight is net.transformer.wte.weight,
            "params": full_state(trainer.state.model),
        }
    finally:
        trainer.close()


def hf_cases(rank: int, world: int) -> dict[str, Any]:
    """Llama and GPT-2 (tied) at their config defaults: the twin kept, against FSDP2 at the same split."""
    out: dict[str, Any] = {}
    for family in ("llama", "gpt2"):
        try:
            chosen = _hf(family, "auto", {"sharded": 3.0}, "auto")
            fixed = _hf(family, "keep", None, max(chosen["split"]))
            chosen["error_fsdp2"] = max_error(chosen.pop("params"), fixed["params"])
            out[family] = chosen
        except Exception:
            out[family] = {"crash": traceback.format_exc()}
    return out


def twin_units(rank: int, world: int) -> dict[str, Any]:
    """The twin's binding: after a `load_state_dict(assign=True)` replaced every FSDP2 parameter, `rebind`
    points the twin at the new storage; a model whose modules cannot be copied keeps FSDP2 with a line."""
    import contextlib
    import io
    import threading

    from automicro.engine.config import FSDP2Config
    from automicro.engine.sharding import shard
    from automicro.engine.twin import UnshardedTwin

    out: dict[str, Any] = {}
    torch.manual_seed(0)
    model = ComposerStack(dropout=0.5)
    model.eval()  # as `from_pretrained` returns a model: the twin is copied in eval mode
    twin = UnshardedTwin.before_sharding(model)
    shard(model, FSDP2Config(), device=torch.device("cpu"))
    twin.bind(model)
    model.train()  # as the trainer does at fit start
    model.load_state_dict({k: v.detach().clone() + 1 for k, v in model.state_dict().items()}, assign=True)
    current = dict(model.named_parameters())

    def stale() -> int:
        return sum(current[name].to_local().data_ptr() != param.data_ptr() for name, _, param in twin.pairs)

    x = torch.randn(4, 8)
    out["stale_before"] = stale()
    out["eval_before"] = sum(not m.training for m in twin.module.modules())
    twin.rebind(model)
    out["stale_after"] = stale()
    out["eval_after"] = sum(not m.training for m in twin.module.modules())
    torch.manual_seed(3)
    through_twin = twin.module((x, None))
    torch.manual_seed(3)  # the same dropout masks: the same numbers
    out["same_output"] = float((through_twin - model((x, None))).abs().max())

    class Locked(ComposerStack):
        def __init__(self) -> None:
            super().__init__()
            self.lock = threading.Lock()  # what deepcopy cannot copy

    printed = io.StringIO()
    locked = Locked()
    with contextlib.redirect_stdout(printed):
        trainer = automicro.Trainer(
            model=locked, train_dataloader=make_loader(1, 2), max_duration="2ba",
            optimizers=torch.optim.AdamW(locked.parameters(), lr=1e-2), device="cpu",
            parallelism_config={"fsdp2": {"on_one_rank": "auto"}}, device_train_microbatch_size="auto",
            loggers=[], progress_bar=False, log_to_console=False, seed=SEED,
        )
        try:
            trainer.fit()
            out["locked_twin"] = trainer.sharded_model.twin is not None
        finally:
            trainer.close()
    out["locked_lines"] = [line for line in printed.getvalue().splitlines() if line.startswith("[automicro] one rank: FSDP2 kept")]
    return out


TOKEN_BATCHES = 36


def token_cases(rank: int, world: int) -> dict[str, Any]:
    """A token budget over variable-length padded batches (`tests/token_cases.py`'s data and limit): the
    twin timed (FSDP2 made slower) and kept, against the same `auto` with FSDP2 pinned."""
    from tests import token_cases

    out: dict[str, Any] = {}
    try:
        lines: list[str] = []
        # Five clean batches before the hooks come off: the trial then starts where this data's long batches leave the
        # twin room to be decided before one runs out of memory (a seeded timeline; the outcome is the memory's).
        auto = AutoMicrobatching(budget="tokens", log_attempts=False, bound_trials=False, stable_batches=5)
        limit = token_cases.TokenLimit(token_cases.limits(world))

        def listen() -> None:
            auto.runtime.info = lambda message: lines.append(message)  # type: ignore[method-assign]

        chosen = token_cases.fit("auto", [auto, limit, SlowArm(auto, {"sharded": 3.0})], batches=TOKEN_BATCHES,
                                 fsdp2={"on_one_rank": "auto"}, before_fit=listen)
        kept = AutoMicrobatching(budget="tokens", log_attempts=False, bound_trials=False, stable_batches=5)
        fixed = token_cases.fit("auto", [kept, token_cases.TokenLimit(token_cases.limits(world))], batches=TOKEN_BATCHES,
                                fsdp2={"on_one_rank": "keep"})
        out = {
            "state": auto.search.sharding_choice.state, "lines": [line for line in lines if line.startswith("one rank:")],
            "same_history": [h[:5] for h in chosen["history"]] == [h[:5] for h in fixed["history"]],
            "error_fsdp2": max_error(chosen["params"], fixed["params"]), "batches": chosen["batches"],
        }
    except Exception:
        out = {"crash": traceback.format_exc()}
    return out


SAVED_AT, RESUMED_TO = 14, 26


def resume_cases(rank: int, world: int, folder: str) -> dict[str, Any]:
    """The twin kept after batch 11, a checkpoint at SAVED_AT; a new trainer loads it (the choice with it:
    not timed again) and trains to RESUMED_TO through the twin bound to the loaded parameters; against an
    uninterrupted run with FSDP2 pinned at the same split."""
    import os

    try:
        saved = _toy("auto", slow={"sharded": 3.0}, batches=SAVED_AT, data_batches=RESUMED_TO, save_folder=folder,
                     save_interval=f"{SAVED_AT}ba")
        resumed = _toy("auto", slow={"sharded": 3.0}, batches=RESUMED_TO, load_path=os.path.join(folder, f"ep0-ba{SAVED_AT}-rank0.pt"))
        fixed = _toy("keep", microbatch=max(saved["split"]), batches=RESUMED_TO)
        out = {
            "saved_state": saved["state"], "resumed_state": resumed["state"], "resumed_lines": resumed["lines"],
            "resumed_through": _through_after(resumed["through"], SAVED_AT),
            "error_fsdp2": max_error(resumed["params"], fixed["params"]),
        }
    except Exception:
        out = {"crash": traceback.format_exc()}
    return out


def _through_after(through: dict[int, bool], start: int) -> list[int]:
    return [batch for batch, yes in through.items() if yes and batch >= start]


def error_case(rank: int, world: int, everywhere: bool) -> dict[str, Any]:
    """A non-OOM error in the twin's first batch (its whole-model compile failing): the batch reruns through
    FSDP2, which trains on; `everywhere`: from batch 6 (the twin's first) every forward raises, through either
    (a bug in the model): the rerun through FSDP2 meets it too and the run ends with it, the trainer's model
    the FSDP2 model again."""
    torch.manual_seed(0)
    model = ComposerStack()
    auto = AutoMicrobatching(log_attempts=False, bound_trials=False)
    through = Through(auto, oom_at=6 if everywhere else 0, error="everywhere" if everywhere else True)
    lines: list[str] = []
    trainer = automicro.Trainer(
        model=model, train_dataloader=make_loader(1, BATCHES), max_duration=f"{BATCHES}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2), device="cpu",
        parallelism_config={"fsdp2": {"on_one_rank": "auto"}}, device_train_microbatch_size="auto",
        callbacks=[auto, through], loggers=[], progress_bar=False, log_to_console=False, seed=SEED,
    )
    auto.runtime.info = lambda message: lines.append(message)  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    try:
        trainer.fit()
        out["params"] = full_state(trainer.state.model)
    except Exception as error:  # noqa: BLE001 - returned to the test
        out["raised"] = f"{type(error).__name__}: {error}"
        chain = error
        while chain.__cause__ is not None or chain.__context__ is not None:
            chain = chain.__cause__ or chain.__context__
            out.setdefault("causes", []).append(f"{type(chain).__name__}: {chain}")
    out["fired"] = through.fired
    out["model_is_fsdp2"] = trainer.state.model is model
    out["lines"] = [line for line in lines if line.startswith("one rank:")]
    out["history"] = [(r.batch, r.size, r.outcome, r.note) for r in auto.history]
    out["through"] = through.batches
    trainer.close()
    if "params" in out:
        out["error_fsdp2"] = max_error(out.pop("params"), _toy("keep", microbatch=8)["params"])
    return out
