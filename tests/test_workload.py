import pytest
import torch

from autotune.errors import UsageError
from autotune.examples import ResNetish, TinyGPT
from autotune.training.workload import Workload, load_object


def test_load_object():
    assert load_object("autotune.examples:TinyGPT", flag="--model") is TinyGPT
    assert load_object("torch.nn.functional:cross_entropy", flag="--loss") is torch.nn.functional.cross_entropy


@pytest.mark.parametrize(
    "spec, message",
    [("nosuchmodule_xyz:Model", "no module named 'nosuchmodule_xyz'"),
     ("autotune.examples:Nope", "has no attribute 'Nope'"),
     ("autotune.examples", "MODULE:ATTR"),
     (":TinyGPT", "MODULE:ATTR")],
)
def test_load_object_errors_say_what_is_wrong(spec, message):
    with pytest.raises(UsageError, match=message):
        load_object(spec, flag="--model")


def test_model_spec_must_build_a_module():
    with pytest.raises(UsageError, match="not an nn.Module class or a factory"):
        Workload.from_specs("tests.models:NOT_CALLABLE")
    with pytest.raises(UsageError, match="built a int"):
        Workload.from_specs("tests.models:not_a_model").build_model()
    with pytest.raises(UsageError, match="cannot build me"):
        Workload.from_specs("tests.models:RaisesInInit").build_model()
    with pytest.raises(UsageError, match="JSON"):
        Workload.from_specs("autotune.examples:TinyGPT", model_kwargs="{n_layer: 2}")
    with pytest.raises(UsageError, match="could not be called"):
        Workload.from_specs("autotune.examples:TinyGPT", model_kwargs='{"depth": 2}').build_model()


def test_model_kwargs_reach_the_model():
    model = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs='{"n_layer": 3}').build_model()
    assert len(model.transformer.h) == 3 and model.training


def test_loss_from_output_attribute_and_example_batch():
    w = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs={"n_layer": 2, "block_size": 8})
    model = w.build_model()
    batch = w.make_batch(model, 3)
    assert batch["idx"].shape == (3, 8)
    assert w.loss(model, batch).ndim == 0


def test_loss_from_model_method_with_tuple_batches():
    w = Workload.from_specs(ResNetish, model_kwargs={"depth": 2, "channels": 4, "image_size": 8})
    model = w.build_model()
    assert w.loss(model, w.make_batch(model, 2)).ndim == 0


def test_loss_from_loss_flag_and_dataset_of_pairs():
    w = Workload.from_specs("tests.models:NoLoss", data="tests.models:pair_dataset", loss="torch.nn.functional:cross_entropy")
    model = w.build_model()
    batch = w.make_batch(model, 8)
    assert batch[0].shape == (8, 4) and batch[1].shape == (8,)
    assert w.loss(model, batch).ndim == 0
    with pytest.raises(UsageError, match="40 items, fewer than the batch size 100"):
        w.make_batch(model, 100)


def test_loss_key_from_dict_items():
    w = Workload.from_specs("tests.models:DictLoss", data="tests.models:dict_dataset")
    model = w.build_model()
    assert w.loss(model, w.make_batch(model, 4)).ndim == 0


def test_missing_loss_says_how_to_fix_it():
    w = Workload.from_specs("tests.models:NoLoss")
    model = w.build_model()
    with pytest.raises(UsageError, match="--loss"):
        w.loss(model, w.make_batch(model, 2))


def test_missing_batches_say_how_to_fix_it():
    w = Workload.from_specs("tests.models:DictLoss")
    with pytest.raises(UsageError, match="--data"):
        w.make_batch(w.build_model(), 2)
