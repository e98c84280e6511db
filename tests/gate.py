"""The gate and the full tier: what `make test` (CI's `.ci/run`) must keep, and what it leaves
to `make test-full`.

The gate is every test except the full tier's. It has a budget: on the recording machine (`tests/costs.json`, the
last recorded `.ci/run` on 2 cores with nothing else running: the docs and venv builds, the calibration, the three
legs, every file and launch) it draws at least a quarter of each file's launches within 30 minutes (so that a
machine 1.33x slower fits ``GATE_BUDGET_S``, CI's 40 minutes), and its floor (one launch a file) fits them too; what
a run draws is the commit's (its seed, and the share its recorded costs give), a machine far slower drawing a step
less (`.ci/costs.py predict`). `tests/test_gate.py` checks the budget against the recorded costs, and that every guarantee
below keeps at least one test in the gate: a change that adds gate tests fits them in the budget in
the same change, by making something cheaper or by moving something to the full tier (``FULL_TIER``,
with what still covers its path in the gate).

The full tier (`make test-full`, `pytest --full`) runs everything: every test below, every cell of the
fault matrices (`tests/matrix.py`) and every 4-rank launch (`tests/conftest.py`).
"""

from __future__ import annotations

from typing import Optional

GATE_BUDGET_S = 40 * 60

# What the README promises -> the gate tests that show it ("file::test function", every parameter of it,
# or "file::test function[id]" for one case). A test named here may not be in FULL_TIER.
GUARANTEES: dict[str, list[str]] = {
    "no deadlock when some ranks run out of memory and others do not (every fault site)": [
        "test_automicro.py::test_two_ranks_oom_at_site_on_rank1_or_every_rank_finds_largest_allowed_size_with_exact_params",
        "test_engine.py::test_recover_after_failure_trains_as_if_it_never_failed",
    ],
    "a steady-state OOM reruns the batch once, the numbers as without it": [
        "test_steady_state.py::test_oom_with_hooks_off_costs_one_retry_on_two_ranks",
        "test_steady_state.py::test_retry_with_dropout_is_bitwise_the_run_without_the_oom",
    ],
    "where one sample does not fit, auto switches activation checkpointing on and trains as the hand-set run": [
        "test_ladder.py::test_where_size_1_runs_out_without_checkpointing_auto_switches_it_on_and_trains_as_the_hand_set_run",
        "test_floor_rule.py::test_a_repeated_oom_at_size_1_switches_checkpointing_on_and_the_run_trains_on_like_the_run_without_it",
    ],
    "an OOM at size 1, or any other error, ends every rank with that error, never a hang": [
        "test_floor_rule.py::test_a_repeated_oom_at_size_1_with_checkpointing_on_ends_the_run_on_every_rank_naming_what_was_tried",
        "test_steady_state.py::test_a_non_oom_error_at_any_site_ends_the_run_on_every_rank_with_that_error",
        "test_steady_state.py::test_unrecoverable_failure_stops_every_rank_within_the_bound_naming_rank_site_batch",
        "test_exit_watch.py::test_every_rank_of_a_run_ended_by_a_non_oom_error_exits_though_its_exit_hangs",
    ],
    "checkpoints: atomic saves, autoresume past a broken newest one, the size found kept": [
        "test_checkpoint.py::test_autoresume_skips_a_broken_newest_checkpoint_and_trains_like_a_run_loaded_from_the_good_one",
        "test_checkpoint.py::test_auto_microbatching_resumes_with_the_size_it_found",
        "test_checkpoint_commit.py::test_a_sigkill_at_each_point_of_a_save_leaves_a_folder_autoresume_resumes_from",
        "test_steady_state.py::test_after_an_unrecoverable_failure_autoresume_starts_below_the_size_that_failed",
    ],
    "routed (mixture-of-experts) models: the search, a fixed run's numbers, routing that moves the memory": [
        "test_moe.py::test_auto_searches_a_routed_model_and_trains_it_as_a_fixed_run_at_the_size_found",
        "test_moe.py::test_a_settled_batch_whose_routing_moved_reruns_once_and_says_so",
    ],
    "a failed attempt leaves nothing held (a failed backward's queued branches, a partial unshard)": [
        "test_capacity.py::test_a_backward_that_raised_leaves_its_ready_branches_queued_until_the_wipe_drains_them",
        "test_moe.py::test_a_routed_model_on_one_rank",
    ],
    "the plain PyTorch loop (AutoStep)": [
        "test_autostep.py::test_a_search_where_one_rank_runs_out_trains_every_batch_like_a_plain_loop",
        "test_autostep.py::test_the_plain_loop_example_runs_on_two_cpu_ranks_under_a_memory_cap",
    ],
    "AutoStep and the batch step every loop shares import no training framework (Composer not needed)": [
        "test_layers.py::test_autostep_trains_on_two_ranks_with_composer_hidden_from_the_import_system",
        "test_layers.py::test_the_loop_neutral_floors_import_no_framework_nor_anything_above_them",
    ],
    "the Hugging Face Trainer": [
        "test_hf_trainer.py::test_the_trainer_searches_where_one_rank_runs_out_and_trains_like_a_plain_loop",
    ],
    "Lightning": [
        "test_lightning.py::test_lightning_searches_where_one_rank_runs_out_and_trains_like_a_plain_loop",
    ],
    "llm-foundry's YAMLs": [
        "test_foundry.py::test_llm_foundrys_pretrain_yaml_trains_evaluates_checkpoints_and_resumes_under_auto",
    ],
    "the installed package runs the main job from any folder (`composer -n N -m automicro.train NAME`)": [
        "test_package.py::test_the_wheel_installed_outside_the_repository_trains_the_shipped_config_by_name",
    ],
    "token budgets: the loss does not depend on the split": [
        "test_token_budget.py::test_per_token_loss_over_token_budget_microbatches_equals_the_unsplit_batch",
        "test_token_budget.py::test_two_ranks_with_different_lengths_agree_on_a_budget_and_on_every_microbatch_count",
    ],
    "packing: packed rows train as the padded batch": [
        "test_packing.py::test_automicro_llama_trains_packed_rows_as_the_unsplit_padded_batch",
    ],
    "pipeline stages": [
        "test_pipeline.py::test_an_oom_on_one_stage_in_forward_di_or_dw_at_the_first_or_last_microbatch_is_retried_without_hang",
        "test_pipeline.py::test_search_on_two_stages_finds_a_size_that_fits_and_trains_like_a_fixed_size_run",
    ],
    "several hosts (the hierarchical consensus)": [
        "test_multinode.py::test_two_nodes_of_two_ranks_find_the_largest_size_with_exact_params",
        "test_multinode.py::test_unrecoverable_oom_on_gloo_nodes_stops_every_rank_within_the_bound_naming_rank_site_batch",
        "test_consensus.py::test_hierarchical_and_gloo_agree_on_every_round_with_late_arrivals",
    ],
    "eval auto": [
        "test_trainer.py::test_eval_oom_on_some_or_all_ranks_retries_at_a_size_that_fits_with_the_same_metric",
    ],
    "compile: OOMs inside compiled code are searched past; the measured graph and scope": [
        "test_compile.py::test_ooms_inside_compiled_forward_and_backward_are_searched_past_and_train_like_eager",
        "test_compile.py::test_the_whole_model_is_timed_against_the_blocks_and_kept_where_faster",
    ],
    "the layout and size trials: the faster kept, the numbers unchanged": [
        "test_layout.py::test_the_faster_trade_is_kept_the_slower_not_and_parameters_equal_a_fixed_run",
        "test_layout.py::test_a_smaller_microbatch_timed_faster_is_kept_and_parameters_equal_a_fixed_run",
    ],
    "trials pay for themselves: each priced before it runs, within 1% of the run, final by batch 25, its price said": [
        "test_trial_plan.py",
        "test_layout.py::test_priced_trials_run_where_they_pay_the_same_on_every_rank_and_the_configuration_is_final_by_batch_25",
        "test_layout.py::test_trials_false_runs_the_search_and_nothing_else",
        "test_sharding_choice.py::test_a_trial_its_price_rules_out_does_not_run_and_its_line_names_the_price",
        "test_sharding_choice.py::test_a_slow_path_in_fsdp2_is_measured_as_idle_and_the_twin_timed_and_kept",
        "test_sharding_choice.py::test_the_scope_trial_reuses_the_one_rank_trials_times_and_goes_back_to_the_blocks_without_compiling",
    ],
    "the vocabulary head: the fused head gives the plain head's numbers and a larger microbatch; auto keeps it where faster": [
        "test_head.py::test_every_transformers_family_it_fuses_gives_the_plain_heads_loss_and_gradients",
        "test_head.py::test_fused_under_fsdp2_on_one_and_two_ranks_trains_to_the_plain_heads_parameters",
        "test_head.py::test_the_main_job_with_a_large_vocabulary_finds_at_least_twice_the_microbatch_fused_and_the_same_loss",
        "test_head.py::test_head_auto_measures_times_and_keeps_the_fused_head_at_the_larger_size_on_every_rank_alike",
    ],
    "CI fits its budget: a slow machine draws fewer launches, never none": [
        "test_costs.py",
        "test_gate.py::test_the_recorded_gate_fits_its_budget",
    ],
    "CI draws the commit's launches: the run before a merge is the run after it, its failures said last": [
        "test_costs.py::test_a_commit_gives_one_seed_on_every_machine_and_another_commit_another",
        "test_costs.py::test_the_share_moves_in_three_fixed_steps_and_not_with_a_calibrations_noise",
        "test_costs.py::test_the_draw_of_one_seed_and_share_is_the_same_every_time",
        "test_costs.py::test_a_failing_test_is_said_last_with_its_line_its_error_and_the_command_that_repeats_it",
    ],
    "a run that stops making progress says where and ends; SIGTERM ends it within seconds": [
        "test_watchdog.py::test_a_stall_is_named_on_every_rank_with_its_stacks_and_ends_the_run",
        "test_watchdog.py::test_sigterm_ends_a_process_whose_main_thread_is_blocked_in_a_collective",
        "test_watchdog.py::test_a_long_legitimate_first_compile_is_not_ended",
        "test_exit_watch.py::test_a_finished_run_whose_exit_hangs_is_ended_with_exit_code_0_and_what_held_it",
    ],
    "the probe and a card not all ours": [
        "test_probe.py::test_one_and_four_ranks_probe_first_and_train_like_the_fixed_size",
        "test_probe.py::test_a_card_another_process_holds_converges_within_two_ooms",
        "test_capacity.py::test_a_failed_attempt_leaves_nothing_allocated_at_any_site_hooks_on_or_off_under_every_layout",
    ],
    "one rank without FSDP2 or unsharded": [
        "test_unsharded.py::test_auto_without_fsdp_on_one_rank_searches_and_trains_like_the_fixed_size",
    ],
    "the main job (`make demo`), its console and dashboards": [
        "test_dashboard.py::test_launcher_runs_tiny_cpu_config_on_two_ranks_with_a_real_search",
    ],
    "on every supported torch (CI's legs 2 and 3 run the `torch_versions` files: tests/conftest.py)": [
        "test_engine.py::test_recover_after_failure_trains_as_if_it_never_failed",
        "test_steady_state.py::test_oom_with_hooks_off_costs_one_retry_on_two_ranks",
        "test_compile.py::test_ooms_inside_compiled_forward_and_backward_are_searched_past_and_train_like_eager",
        "test_pipeline.py::test_an_oom_on_one_stage_in_forward_di_or_dw_at_the_first_or_last_microbatch_is_retried_without_hang",
        "test_checkpoint.py::test_autoresume_skips_a_broken_newest_checkpoint_and_trains_like_a_run_loaded_from_the_good_one",
    ],
    "a bad input is one clear error naming what to change": [
        "test_user_errors.py",
        "test_e2e.py::test_bad_config_fails_before_any_process_starts_with_the_key_named",
    ],
}

# Test function -> None (every case) or the (parameter, value) of the one case in the full tier only,
# with the gate test that runs the same path. Costs are per leg-1 run on 2 cores (2026-11-29).
FULL_TIER: dict[str, Optional[tuple[str, str]]] = {
    # 47 s. The gate: the foundry pretrain YAML (the foundry path) and the two-rank fault matrix with a
    # cap on one rank (test_automicro), GPT-2 under asymmetric memory (test_hf_models).
    "test_a_foundry_yaml_searches_under_asymmetric_caps_and_trains_like_the_fixed_size_run": None,
    # 41 s: llm-foundry's finetuning YAML under a token budget. The gate: llm-foundry's pretrain YAML (its train path,
    # evaluation, checkpoints and resume under `auto`), a token budget over variable-length padded batches with a
    # transformers model (test_token_budget, test_packing).
    "test_llm_foundrys_finetuning_path_trains_under_auto_with_a_token_budget": None,
    # 48 s. The gate: autoresume below the size that failed (test_steady_state), past a broken newest
    # checkpoint (test_checkpoint), from a rank killed mid-save (test_checkpoint_commit).
    "test_restart_with_autoresume_finishes_a_run_lost_between_batches_below_the_size_in_use": None,
    # 74 s in all. Several hosts in the gate: 2 nodes of 2 ranks (the search on every site, an OOM
    # after the hooks came off, an unrecoverable OOM), the main job as two nodes under torchrun, an OOM
    # between batches on two nodes. Here: the same on nodes of one rank, and the composer launcher.
    "test_four_nodes_of_one_rank_find_the_largest_size_with_exact_params": None,
    "test_oom_after_hooks_off_on_two_nodes_costs_one_batch_retry_with_params_equal_to_no_oom": None,
    "test_harness_runs_the_main_job_as_two_nodes_with_the_hierarchical_consensus": ("launcher", "composer"),
    "test_oom_between_batches_stops_every_rank_naming_the_rank_and_event_and_leaves_the_note": ("nodes", "1"),
    # 29 s: the probe against the whole batch first, counted in OOMs. The gate: the probe on one rank
    # trains like the fixed size (test_probe), its OOM bounds (the property tests, no launch).
    "test_two_ranks_probe_first_finds_the_size_with_fewer_ooms_than_the_whole_batch_first": None,
    # 16 s: a non-OOM error with `steady_recovery: false` (the job-lost alarm). The gate: the same
    # between batches (the ledger's board), and at every site (test_steady_state).
    "test_a_non_oom_error_on_one_rank_is_named_on_every_rank": ("case", "run_error_without_ledger"),
    # 52 s on leg 1 and about as much on legs 2 and 3: the HF Trainer's and Lightning's examples under
    # torchrun. The gate: each adapter's 2-rank launch (the same callback, loop and checks) and the plain
    # loop's example (test_autostep).
    "test_the_trainer_example_runs_on_two_cpu_ranks_under_a_memory_cap": None,
    "test_the_lightning_example_runs_on_two_cpu_ranks_under_a_memory_cap": None,
    # 25 s: the layout trials on one rank. The gate: the same on 2 ranks (the slowest rank decides),
    # and the size trials on 1 and 2 ranks.
    "test_the_faster_trade_is_kept_the_slower_not_and_parameters_equal_a_fixed_run": ("world", "1"),
    # About 65 s on the torch 2.15 leg (two launches: torchtitan builds one Trainer a process): torchtitan's compiled
    # blocks on one rank. The gate: the move of the compile from `nn.Module.compile` to the forwards, the sync hooks
    # eager around them, on every torch (test_compile, no launch); torchtitan's own Trainer under `auto` on 2 ranks
    # (the search, a late OOM, DCP resume) and under torchrun.
    "test_one_rank_compiled_searches_down_to_size_one_and_trains_like_torchtitan_at_one_sample": None,
}
