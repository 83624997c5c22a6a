"""The worst batch, random batches and real tokens; limits that hold for a whole shuffled epoch."""

import pytest
import torch

import autotune
from autotune.training.data import random_indices, real_tokens, scan_items, worst_indices
from autotune.examples import pad_collate, variable_token_loader
from autotune.meters import TensorMeter
from autotune.records import Config
from autotune.training.trainer import Trainer
from autotune.training.workload import Workload, to_device
from tests.models import _WithLengths, pad_images, varied_images

TINY = {"n_layer": 4, "block_size": 64, "n_embd": 32, "n_head": 4, "vocab_size": 64}


def test_the_worst_batch_holds_the_longest_items():
    dataset = variable_token_loader(size=200, block_size=64, vocab_size=64).dataset
    items = scan_items(dataset)
    lengths = [len(dataset[i]["idx"]) for i in range(len(dataset))]
    assert items.method == "exhaustive" and items.quantiles()["max"] == max(lengths) == 64
    for b in (1, 4, 16):
        chosen = worst_indices(items, b)
        assert len(set(chosen)) == b
        assert sorted((lengths[i] for i in chosen), reverse=True) == sorted(lengths, reverse=True)[:b]
        batch = pad_collate([dataset[i] for i in chosen])
        assert batch["idx"].shape == (b, 64)  # padded to the longest item of the dataset
    assert items.to_dict()["p50"] < items.to_dict()["p90"] <= 64


def test_two_padded_dimensions_meet_both_maxima():
    dataset = varied_images()
    items = scan_items(dataset)
    images, _ = pad_images([dataset[i] for i in worst_indices(items, 2)])
    assert images.shape == (2, 3, 24, 20)  # the tallest and the widest, though no single item is both
    assert pad_images([dataset[i] for i in worst_indices(items, 1)])[0].shape[2:] == (24, 8)


def test_sizes_from_a_lengths_attribute_or_a_bounded_sample():
    items = scan_items(_WithLengths())
    assert items.method == "lengths" and worst_indices(items, 2) == [1, 3]
    dataset = variable_token_loader(size=300, block_size=64, vocab_size=64).dataset
    sampled = scan_items(dataset, max_scan=50)
    assert sampled.method == "sample" and len(sampled.indices) == 50 and sampled.to_dict()["read"] == 50


def test_random_batches_are_the_same_for_every_configuration_and_differ_by_draw():
    a = [random_indices(100, 8, draw) for draw in range(3)]
    assert a == [random_indices(100, 8, draw) for draw in range(3)]
    assert len({tuple(x) for x in a}) == 3 and all(len(set(x)) == 8 for x in a)


def test_real_tokens():
    assert real_tokens({"input_ids": torch.ones(2, 5), "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1] * 5])}) == 8
    assert real_tokens({"idx": torch.ones(2, 3), "targets": torch.tensor([[1, 2, -100], [3, -100, -100]])}) == 3
    assert real_tokens((torch.ones(2, 3), torch.tensor([0, 1]))) is None  # images and class labels: no tokens


def test_trials_measure_the_worst_batch_and_time_random_ones():
    workload = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=TINY, data="tests.models:tiny_variable_loader")
    model = workload.build_model()
    assert workload.make_batch(model, 8)["idx"].shape == (8, 64)  # the first 8 items are short; the worst is not
    first = workload.collate([workload.dataset[i] for i in range(8)])
    assert first["idx"].shape[1] < 64
    draws = [workload.sample_batch(model, 8, d) for d in range(3)]
    assert not torch.equal(draws[0]["idx"][:, :4], draws[1]["idx"][:, :4])
    m = autotune.run_trial(workload, Config("fp32", "0", 8), device="cpu", meter=TensorMeter(),
                           settings=autotune.TrialSettings(measure_steps=3))
    assert m.status == "ok" and len(m.step_times_s) == 3 and m.step_s_spread is not None and m.tokens_per_s > 0


def _epoch_peak(workload, config, budget_bytes):
    """One shuffled epoch over the whole dataset, metered under the budget: the largest step peak."""
    loader = torch.utils.data.DataLoader(workload.dataset, batch_size=config.batch_size, shuffle=True,
                                         collate_fn=workload.collate_fn, generator=torch.Generator().manual_seed(5))
    trainer = Trainer(workload, config, torch.device("cpu"))
    with TensorMeter(budget_bytes=budget_bytes).measure() as handle:
        trainer.build()
        for batch in loader:
            trainer.step(to_device(batch, torch.device("cpu")))
    return handle.reading.peak_bytes


def test_every_reported_limit_holds_for_a_whole_shuffled_epoch(tmp_path):
    """The long-tailed data of the bundled loader: one item in twenty is four times the typical length."""
    report = autotune.tune("autotune.examples:TinyGPT", model_kwargs=TINY, data="tests.models:tiny_variable_loader",
                           device="cpu", budget="12MiB", precisions="fp32,bf16", segments="0,2", batch_sizes="4..64",
                           measure_steps=2, probe=False, eval_limits=False,  # training's limits: eval_limits' own
                           storage=f"sqlite:///{tmp_path}/d.db", study="d")
    workload = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=TINY, data="tests.models:tiny_variable_loader")
    limits = [(r["precision"], r["segments"], r["max_batch_size"]) for r in report.limits if r["max_batch_size"]]
    assert len(limits) == 4 and report.recommendation is not None
    configs = {Config(*limit) for limit in limits} | {report.recommendation.config}
    for config in sorted(configs):
        peak = _epoch_peak(workload, config, report.budget_bytes)  # raises an OOM if a step crosses the budget
        assert peak <= report.budget_bytes
        # measured, or implied by the variant's prediction (confirmed by a trial): the worst batch bounds the epoch
        trial = next(m for m in (*report.trials, *report.predictions) if m.config == config)
        assert peak <= trial.peak_bytes  # the worst batch bounds every batch of the epoch
    assert report.data["method"] == "exhaustive" and report.data["max"] == 64


def test_without_data_the_limits_say_they_hold_for_the_example_batch(tmp_path, caplog):
    with caplog.at_level("INFO", logger="autotune"):
        report = autotune.tune("autotune.examples:TinyGPT", model_kwargs=TINY, device="cpu", budget="64MiB",
                               precisions="fp32", segments="0", batch_sizes="2", measure_steps=1,
                               storage=f"sqlite:///{tmp_path}/n.db", study="n")
    assert report.data is None
    assert sum("example_batch" in n for n in report.notices) == 1
    assert sum("example_batch" in r.message for r in caplog.records) == 1


def test_a_loader_with_its_own_batch_sampler_gets_a_notice_not_a_crash(tmp_path):
    report = autotune.tune("autotune.examples:TinyGPT", model_kwargs=TINY, data="tests.models:bucketed_loader",
                           device="cpu", budget="64MiB", precisions="fp32", segments="0", batch_sizes="4,8",
                           measure_steps=1, probe_top=1, storage=f"sqlite:///{tmp_path}/b.db", study="b")
    assert report.recommendation is not None
    assert any("batch_sampler (list) is not used" in n and "at most b items" in n for n in report.notices)


def test_an_iterable_dataset_is_bad_input(tmp_path):
    with pytest.raises(autotune.UsageError, match="map-style"):
        autotune.tune("autotune.examples:TinyGPT", model_kwargs=TINY, data="tests.models:stream", device="cpu",
                      storage=f"sqlite:///{tmp_path}/s.db")
