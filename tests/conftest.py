import os
import re

# One intra-op thread, here and in every process a test starts (CLIs, parallel workers, isolated trials, torchrun's
# ranks inherit it): on two cores, two workers of two threads each, or a trial beside a CPU hog or CI's install,
# left OpenMP's threads spinning for each other (two workers on one study: 41-56 s of wall time and 54-70 s of CPU
# with the default of two threads, 13-15 s and 14 s with one, on a loaded machine). The models here are too small
# to gain from a second thread. Set before torch is imported; OMP_NUM_THREADS=N in the environment overrides it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.procs import Started  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# A TinyGPT small enough that a trial takes a fraction of a second on two CPU cores.
TINY_GPT = {"n_layer": 4, "block_size": 32, "n_embd": 32, "n_head": 4, "vocab_size": 64}


# The modules that take longest on CI's two processes, most first (after each, its CPU seconds in one run of
# `-m "not serial"`; test_compile.py's alone). pytest-xdist's loadscope hands modules out by
# test count, most first, which left modules of few but slow tests (test_integrations, test_world_size,
# test_end_to_end) to the end, where one process finished its last module alone while the other sat idle. Here the
# processes take these modules first, then the rest in file order, where the quick ones even out the end. A module
# missing here only runs later; a list out of date costs seconds, never a test.
SLOWEST_FIRST = ("test_dry_run.py",  # 60-80 (seconds of one process, --durations=0 of the tier, 2026-12-07)
                 "test_zoo.py",  # 49
                 "test_cli.py",  # 47
                 "test_eval_limits.py", "test_integrations.py", "test_data.py",  # 25-38 each
                 "test_reliability.py", "test_world_size.py",  # 27-29: the tests not marked serial
                 "test_thirdparty.py", "test_isolation.py", "test_tuner.py",  # 22 each
                 "test_published.py", "test_end_to_end.py", "test_probe.py", "test_compile.py",  # 13-18 each
                 "test_progress.py", "test_cuda_plan.py", "test_allocator_meter.py")  # 11-13 each


# The full tier (marker ``full``): the wider matrix and the longest end-to-end runs, each beside a sibling that CI's
# tier keeps (the same promise on another model, precision or path). ``python3 -m tests`` (CI's command) leaves them
# out to stay within CI's ten minutes on two cores; ``python3 -m tests --full`` runs every test (about 25 minutes).
# Run the full tier before changing what these cover: the dry run's predictions, the trainers, the isolation venue.
# Node ids, or their start (a ``*`` matches anything): each with the sibling that stays in CI's tier after the arrow.
FULL_TIER = (
    "tests/search/test_predicted_search.py::test_with_data_whose_items_are_views",  # -> a real search from predictions
    "tests/integrations/test_integrations.py::test_a_hugging_face_trainer_is_tuned_and_then_trains",  # -> HF tuned with eval data
    "tests/integrations/test_integrations.py::test_a_lightning_trainer_is_tuned_and_then_fits",  # -> Lightning with validation
    "tests/integrations/test_integrations.py::test_a_configure_optimizers_that_sizes_a_one_cycle",  # -> Lightning with validation
    "tests/execution/test_isolation.py::test_a_worker_that_holds_more_than_before_its_first_trial",  # -> warm worker tests
    "tests/execution/test_isolation.py::test_a_worker_killed_between_two_trials_is_replaced_and_the_next_trial_runs[found",
    "tests/execution/test_isolation.py::test_a_trial_in_a_worker_counts_the_workers_start_as_set_up",  # -> setup_s in-process
    "tests/test_end_to_end.py::test_bf16_and_checkpointing_fit_larger_batches[TinyGPT]",  # -> [ResNetish]
    "tests/test_dry_run.py::test_a_dry_run_of_a_model_whose_fake_kernel_is_stricter",  # -> measured for real
    "tests/test_dry_run.py::test_a_model_that_deep_copies_its_fake_layers_is_planned_without_a_crash"
    "[TransformerReadingItsActivations",
    "tests/test_dry_run.py::test_a_search_measures_the_recommended_limit_exactly",  # -> limits at L and L+1 for real
    # -> conftest's _global_state_put_back, after every module of CI's tier: no module leaves torch's configuration
    # changed, whatever runs next (this runs the two modules that compile in one process, in both orders: 57 s)
    "tests/test_order.py::test_the_modules_that_compile_pass_in_one_process_in_either_order",
    "tests/test_dry_run.py::test_a_model_larger_than_this_machine_is_planned_without_its_memory[fsdp-state]",
    # the zoo's predictions against measurement: llama, cnn_batchnorm and the members kept below stay in CI's tier
    *(f"tests/test_dry_run.py::test_the_zoo_is_predicted_as_it_is_measured[{name}]" for name in (
        "llama_lora", "torch_transformer", "gemma2", "opt", "gpt_neox", "gpt2", "per_layer_args", "dropout_experts",
        "qwen2_hooked", "bart")),
    # every plan kind of the bundled models: ResNetish in every precision stays
    *(f"tests/test_dry_run.py::test_a_prediction_is_the_measurement_to_the_byte_for_every_plan_kind[autotune.examples:"
      f"TinyGPT-tiny_gpt-{precision}]" for precision in ("fp32", "fp16", "bf16")),
    "tests/training/test_compile.py::test_a_compiled_recommendation_is_timed_again_static",  # -> the compiled search
    "tests/execution/test_probe.py::test_variable_lengths_do_not_surprise_the_probe",  # -> the probe's epoch, the data's limits
    "tests/execution/test_reliability.py::test_a_warm_worker_killed_between_two_trials_of_a_search",  # -> killed by SIGKILL
    "tests/execution/test_reliability.py::test_two_workers_share_one_study_without_overlap[journal]",  # -> [sqlite]
    # -> [sqlite]; PostgreSQL stays in CI's tier under load (test_workers_under_load[auto-3-postgres])
    "tests/execution/test_reliability.py::test_two_workers_share_one_study_without_overlap[postgres]",
    "tests/execution/test_reliability.py::test_two_workers_with_the_auto_strategy_split_its_trials",  # -> two workers, grid
    "tests/execution/test_reliability.py::test_the_stopping_tests_pass_under_a_runner_that_ignores_int_and_hup",
    "tests/execution/test_world_size.py::test_one_rank_under_fsdp2_s_mixed_precision_is_predicted_to_the_byte[tests.zoo:llama",
    "tests/execution/test_world_size.py::test_the_dry_run_says_each_precisions_mixed_precision",
    "tests/execution/test_world_size.py::test_the_predicted_rank_is_a_real_gloo_ranks_peak_to_the_byte[fsdp",  # -> [ddp]
    "tests/search/test_workers_under_load.py::test_workers_under_load_never_crash_duplicate_or_spin[grid-3-sqlite]",
    "tests/search/test_workers_under_load.py::test_workers_under_load_never_crash_duplicate_or_spin[auto-3-journal]",
    "tests/test_eval_limits.py::test_a_dry_run_predicts_the_same_limits",
    "tests/timing/test_timing.py::test_this_cpus_calibration_is_cached",  # -> the timing tests read this CPU's cache
    # CI's time after every search's exact limits and their confirmation (issue 47):
    "tests/test_examples.py::test_the_hf_factory_example_tunes_from_the_command_line[tiny-gpt2-with-its-data]",  # -> [config-folder
    "tests/test_dry_run.py::test_a_dry_runs_limits_hold_for_real_at_l_and_fail_at_the_next_size[autotune.examples:TinyGPT",  # -> ResNetish
    "tests/test_dry_run.py::test_a_dry_run_for_a_card_plans_its_memory_capability_and_time",  # -> the card's bad input
    "tests/execution/test_probe.py::test_probe_trains_an_epoch_over_a_tenth_of_the_data",  # -> the probe's rejections
    # timm's search in CI's second environment calibrates that torch's CPU first (a cache per torch version): 36 s
    "tests/test_thirdparty.py::test_third_party_model_tuned_under_a_budget[vit]",  # -> the other libraries' models  # -> the search's limits, measured
    "tests/test_published.py::test_a_row_that_ran_out_is_predicted_out_of_memory",  # -> a row predicted and read
    "tests/test_examples.py::test_the_hf_factory_example_tunes_from_the_command_line[config-folder-by-name]",
    "tests/cli/test_cli.py::test_exports_and_plots_are_written_next_to_the_json",  # -> the exports in-process
    "tests/test_dry_run.py::test_the_cli_dry_run_predicts_labels_and_stores_nothing",  # -> the CUDA plan's CLI run
    "tests/test_dry_run.py::test_a_model_that_deep_copies_its_fake_layers_is_planned_without_a_crash"
    "[TransformerReadingItsMask",  # -> tests/execution/test_known_values.py
    "tests/search/test_predicted_search.py::test_a_real_search_starts_from_predictions",  # -> the seeded strategies' tests
    "tests/execution/test_world_size.py::test_the_rank_count_nothing_fits_suggests_is_checked",  # -> one rank's share of state
    "tests/execution/test_distributed.py::test_running_the_job_again_reuses_every_trial",  # -> a study's reuse in one process
    "tests/execution/test_distributed.py::test_a_stopped_job_exits_with_the_signals_code_on_every_rank_and_keeps_its_trials[15",
    "tests/search/test_workers_under_load.py::test_workers_under_load_never_crash_duplicate_or_spin[auto-2-sqlite]",  # -> PG
    "tests/execution/test_reliability.py::test_sigterm_is_handled_as_ctrl_c_and_exits_143[process]",  # -> [none]
    "tests/execution/test_reliability.py::test_a_search_killed_with_sigkill_leaves_no_worker_training",  # -> killed, resumed
    "tests/training/test_data.py::test_a_loader_with_its_own_batch_sampler_gets_a_notice",  # -> the loaders' other tests
    "tests/execution/test_isolation.py::test_a_warm_worker_that_hangs_is_killed_after_the_limit",  # -> an isolated trial hangs
    "tests/test_dry_run.py::test_a_prediction_is_the_measurement_to_the_byte_for_every_plan_kind[autotune.examples:"
    "ResNetish-kwargs1-fp16]",  # -> ResNetish in fp32 and bf16
    "tests/execution/test_world_size.py::test_the_report_says_it_predicted_one_rank_and_the_group_is_gone",  # -> one rank's peak
    "tests/execution/test_reliability.py::test_two_workers_share_one_study_without_overlap[sqlite]",  # -> [postgres]
    "tests/test_thirdparty.py::test_third_party_model_tuned_under_a_budget[gpt2]",  # -> the HF factory's CLI run
    "tests/test_dry_run.py::test_the_zoo_is_predicted_as_it_is_measured[t5]",  # -> llama, cnn_batchnorm, ...
    "tests/integrations/test_integrations.py::test_a_hugging_face_trainer_evaluates_its_eval_dataset",  # -> Lightning's validation
    "tests/execution/test_distributed.py::test_a_hugging_face_trainer_is_tuned_on_every_rank",  # -> torchrun ddp and fsdp
    # the compiled search (one module fixture): -> a compiled step metered (tests/meters/test_allocator_meter.py) and this
    # module's compile failures, hangs and refusals
    *(f"tests/training/test_compile.py::{name}" for name in (
        "test_every_configuration_is_measured_eager_and_compiled", "test_a_variant_compiles_at_most_twice_in_a_search",
        "test_plans_are_checked_compiled_against_compiled", "test_the_table_and_the_recommendation_say_whether_to",
        "test_a_compiled_recommendation_is_applied_and_exported_compiled",
        "test_no_compile_cache_lands_in_the_working_directory")),
    # the zoo's memory checks in bf16: fp32 stays for every member (its plan exactness in both)
    "tests/test_zoo.py::test_plans_known_to_need_no_more_memory_do_not[*-bf16]",
    "tests/test_zoo.py::test_one_step_after_priming_the_optimizer_peaks_as_two_steps_did[*-bf16]",
)


def pytest_itemcollected(item):  # as each test is collected: before -m deselects by marker
    """Mark the full tier's tests (FULL_TIER) ``full``."""
    if in_full_tier(item.nodeid):
        item.add_marker(pytest.mark.full)


def matches(nodeid: str, entry: str) -> bool:
    """Whether ``nodeid`` starts as FULL_TIER's ``entry`` says (its ``*`` matching anything; brackets as written)."""
    return re.match(re.escape(entry).replace(r"\*", ".*"), nodeid) is not None


def in_full_tier(nodeid: str) -> bool:
    """Whether ``nodeid`` is one of FULL_TIER's tests."""
    return any(matches(nodeid, entry) for entry in FULL_TIER)


def pytest_configure(config):
    """Under ``--dist loadscope``, hand modules out in collection order (SLOWEST_FIRST's), not by test count: what
    pytest-xdist 3.7 and later do with ``--no-loadscope-reorder``."""
    if getattr(config.option, "dist", None) == "loadscope" and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """On pytest-xdist's processes, the slowest modules first (SLOWEST_FIRST); each module's tests stay in order."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def _global_state() -> dict:
    """torch's process-wide settings a test could leave changed: the module after it would run under them."""
    import sys

    state = {"threads": torch.get_num_threads(), "default_dtype": torch.get_default_dtype(),
             "deterministic": torch.are_deterministic_algorithms_enabled(), "grad": torch.is_grad_enabled(),
             "matmul_precision": torch.get_float32_matmul_precision()}
    for name in ("torch._inductor.config", "torch._dynamo.config", "torch._functorch.config"):
        config = sys.modules.get(name)  # imported by a test that compiles: compared from then on
        if config is not None:
            state.update({f"{name}.{key}": value for key, value in config.get_config_copy().items()
                          if not callable(value)})
    return state


@pytest.fixture(autouse=True, scope="module")
def _global_state_put_back():
    """Every module leaves torch's global configuration as it found it, so that the suite passes in any order and
    in one process (a module that changed inductor's config broke the next one that compiled)."""
    before = _global_state()
    yield
    after = _global_state()
    changed = {key: (before[key], after[key]) for key in before if key in after and before[key] != after[key]}
    assert not changed, f"this module left torch's global configuration changed: {changed}"


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture
def tiny_gpt_kwargs():
    return dict(TINY_GPT)


@pytest.fixture
def storage(tmp_path):
    return f"sqlite:///{tmp_path / 'trials.db'}"


@pytest.fixture
def processes():
    """A list for the processes a test starts: killed, reaped and their pipes closed when the test ends, passed,
    failed or timed out, so that a failing test leaves nothing running (and no unclosed pipe) for the tests after
    it. A process that leads a process group of its own (``start_new_session=True``) is killed with its group: what
    it started too, such as a CLI's isolated workers, also after the process itself has exited."""
    started = Started()
    yield started
    started.stop_all()


def pytest_collection_finish(session):
    """Freeze what exists once the tests are collected (torch, pytest, the test modules): the full collection that
    ends every trial (``Backend.release``) then walks only what the tests make, as a search's does (search.py)."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank in this process (what a DeviceMesh needs), destroyed afterwards."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this test process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
