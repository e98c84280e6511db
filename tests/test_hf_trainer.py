"""`automicro.hf.AutoMicrobatchTrainer`: the Hugging Face `Trainer` with `auto` microbatching, on a
tiny Llama built from a config and sharded with `fully_shard`, 2 and 4 gloo ranks under the hang
watchdog (tests/hf_trainer_cases.py). Every reference is a plain loop with no automicro and no
Trainer, over the batches the Trainer handed each rank."""

from __future__ import annotations

import re

import pytest

from automicro.testing.multiprocess import run_multiprocess
from tests import hf_trainer_cases as cases
from tests.adapter_checks import check_steady_oom
from tests.launch import run_example
from tests.toy_models import max_error

pytestmark = pytest.mark.hf

TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=[(2, 1), pytest.param((4, 2), marks=pytest.mark.many_ranks)], ids=["2-ranks", "4-ranks"])
def ranks(request):
    world, one_rank = request.param
    return world, one_rank, run_multiprocess(cases.run_cases, world_size=world, args=(one_rank,), timeout_s=400)


@pytest.mark.multiproc
def test_the_trainer_searches_where_one_rank_runs_out_and_trains_like_a_plain_loop(ranks):
    world, one_rank, per_rank = ranks
    for rank, out in enumerate(per_rank):
        run = out["search"]
        # The Trainer's accumulation is automicro's: it hands the whole step's batch (4 x 2) at once.
        assert run["args"] == (cases.PER_DEVICE * cases.ACCUMULATION, 1)
        ooms = [h for h in run["history"] if h["outcome"] == "oom"]
        assert ooms and all(h["failed_ranks"] == [one_rank] for h in ooms), run["history"]
        assert [r["split"] for r in run["results"]] == [r["split"] for r in per_rank[0]["search"]["results"]]
        assert all(max(r["split"]) <= 5 and sum(r["split"]) == 8 for r in run["results"]), run["results"]
        assert run["results"][0]["attempts"] > 1 and run["results"][-1]["attempts"] == 1
        assert run["results"][-1]["hooks"] is False
        assert len(run["results"]) == cases.MAX_STEPS and run["steps"] == [cases.MAX_STEPS]
        assert max_error(run["params"], run["reference"]) <= TOLERANCE, rank
        assert max_error(run["params"], run["whole"]) <= TOLERANCE, rank
        # The Trainer's log lines carry the automicro figures (wandb, tensorboard, ... get them as they are).
        last = [line for line in run["logged"] if "loss" in line][-1]
        assert last["automicro/found_size"] == 5 and last["automicro/ooms_total"] == len(ooms), last
        assert last["automicro/last_oom_rank"] == one_rank
        # The evaluation ran after step 3 (batch 2), and the search guarded the batches after it again: the size
        # was found at batch 1, so without the re-arm the hooks would be off after batch 3 (2 stable batches);
        # re-armed after batch 2, they come off after batch 4.
        assert [line["step"] for line in run["logged"] if "eval_loss" in line] == [3, 6], run["logged"]
        assert run["results"][1]["size"] == 5 and run["results"][1]["attempts"] > 1, run["results"]
        assert [r["hooks"] for r in run["results"]] == [True, True, True, True, False, False], run["results"]


@pytest.mark.multiproc
def test_an_oom_after_the_hooks_are_off_costs_the_trainer_one_rerun_of_that_step(ranks):
    world, one_rank, per_rank = ranks
    for rank, out in enumerate(per_rank):
        run = out["steady"]
        check_steady_oom(run, one_rank, rank)
        assert run["steps"] == [7]


@pytest.mark.multiproc
def test_a_resumed_trainer_starts_at_the_saved_split_and_ends_like_an_unbroken_loop(ranks):
    world, one_rank, per_rank = ranks
    for rank, out in enumerate(per_rank):
        run = out["resume"]
        first, second = run["first"], run["second"]
        assert first["state"]["batches"] == 3 and second["state"]["batches"] == 6
        # The resumed run trains at the saved split from its first step: no search, no OOM.
        assert second["results"][0]["split"] == first["results"][-1]["split"]
        assert all(r["attempts"] == 1 for r in second["results"]), second["results"]
        assert not [h for h in second["history"] if h["outcome"] == "oom" and h["batch"] >= 3], second["history"]
        assert max_error(second["params"], run["reference"]) <= TOLERANCE, rank


@pytest.mark.multiproc
def test_flattened_batches_are_cut_at_sample_starts_and_train_like_a_plain_loop(ranks):
    world, one_rank, per_rank = ranks
    for rank, out in enumerate(per_rank):
        run = out["flattened"]
        # One row per step (the collator's), 8 samples in it; split into samples at most 5 after the OOMs.
        assert all(rows[0] == 1 for rows in run["rows"]), run["rows"]
        ooms = [h for h in run["history"] if h["outcome"] == "oom"]
        assert ooms and all(h["failed_ranks"] == [one_rank] for h in ooms), run["history"]
        assert all(max(r["split"]) <= 5 and sum(r["split"]) == 8 for r in run["results"]), run["results"]
        assert max_error(run["params"], run["reference"]) <= TOLERANCE, rank


@pytest.mark.multiproc
def test_the_trainer_refuses_what_it_cannot_guard_with_what_to_change(ranks):
    world, one_rank, per_rank = ranks
    for out in per_rank:
        errors = out["errors"]
        assert errors["checkpoints"]["type"] == "ValueError"
        assert "save_strategy='no'" in errors["checkpoints"]["message"]
        assert "fsdp_version" in errors["checkpoints"]["message"]
        assert errors["ddp"]["type"] == "TypeError", errors["ddp"]
        assert "DistributedDataParallel" in errors["ddp"]["message"] and "fsdp_version" in errors["ddp"]["message"]


def test_the_trainers_own_batch_search_and_unknown_settings_are_refused_by_name(tmp_path):
    from transformers import TrainingArguments

    from automicro.hf import AutoMicrobatchTrainer

    args = TrainingArguments(output_dir=str(tmp_path), auto_find_batch_size=True, use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="auto_find_batch_size=True.*set auto_find_batch_size=False"):
        AutoMicrobatchTrainer(model=cases.llama(), args=args)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(TypeError, match=r"unknown automicro setting\(s\) \['max_grad_norm'\].*TrainingArguments.max_grad_norm"):
        AutoMicrobatchTrainer(model=cases.llama(), args=args, automicro={"max_grad_norm": 1.0})


@pytest.mark.multiproc
def test_the_trainer_example_runs_on_two_cpu_ranks_under_a_memory_cap():
    """examples/hf_trainer.py as a user runs it (torchrun, 2 gloo ranks), under a watchdog."""
    output = run_example("hf_trainer.py", "--steps", "5")
    # The emulated limit made the search run out of memory, and training went on to the last step.
    found = re.search(r"trained (\d+) steps; split in use \[[\d, ]+\], OOMs (\d+)", output)
    assert found is not None, output[-4000:]
    assert int(found.group(1)) == 5 and int(found.group(2)) >= 1, found.group(0)
    assert "automicro/found_size" in output  # the Trainer's log lines carry the figures


def test_a_flattened_row_is_cut_at_its_sample_starts_and_whole_row_extras_are_refused():
    import torch

    from automicro.batch import flattened
    from automicro.batch.torch_host import count_samples

    row = {"input_ids": torch.arange(10)[None], "labels": torch.arange(10)[None],
           "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0]])}
    assert flattened.is_flattened(row) and count_samples(row) == 4
    first, second = flattened.split(row, (2, 2))
    assert first["position_ids"].tolist() == [[0, 1, 2, 0, 1]] and second["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert [count_samples(part) for part in flattened.split(row, (3, 1))] == [3, 1]
    assert not flattened.is_flattened({"input_ids": torch.zeros(2, 5), "position_ids": torch.zeros(2, 5)})
    with pytest.raises(flattened.FlattenedBatchError, match="return_flash_attn_kwargs"):
        flattened.split({**row, "cu_seq_lens_q": torch.tensor([0, 3, 5, 9, 10])}, (2, 2))
