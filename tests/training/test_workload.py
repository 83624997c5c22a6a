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


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_warm_workload_hands_out_exact_copies_of_the_model_a_seeded_build_gives():
    import threading

    from autotune.records import Config
    from autotune.training.trainer import Trainer

    def losses(workload, warm):
        if warm:
            workload.warm(0)
        trainer = Trainer(workload, Config("fp32", "2", 4), torch.device("cpu"))
        trainer.build()
        batch = trainer.module.example_batch(4)
        for _ in range(3):
            trainer.step(batch)  # dropout draws from the random state the build left
        return trainer.losses, torch.get_rng_state()

    spec = dict(model_kwargs={"n_layer": 2, "block_size": 16, "n_embd": 32, "n_head": 2, "vocab_size": 64,
                              "dropout": 0.3})
    fresh = Workload.from_specs("autotune.examples:TinyGPT", **spec)
    warm = Workload.from_specs("autotune.examples:TinyGPT", **spec)
    warm.warm(0)
    a, b = fresh.build_model(seed=0), warm.build_model(seed=0)
    assert a is not b and all(torch.equal(x, y) for x, y in zip(_state(a).values(), _state(b).values()))
    assert warm.build_model(seed=0) is not b  # a copy each time
    cold_losses, cold_rng = losses(Workload.from_specs("autotune.examples:TinyGPT", **spec), warm=False)
    warm_losses, warm_rng = losses(Workload.from_specs("autotune.examples:TinyGPT", **spec), warm=True)
    assert cold_losses == warm_losses and torch.equal(cold_rng, warm_rng)

    class Locked(torch.nn.Linear):  # a model that cannot be deep-copied is built every time
        def __init__(self):
            super().__init__(2, 2)
            self.lock = threading.Lock()

    locked = Workload.from_specs(Locked)
    locked.warm(0)
    assert locked._found[("model", 0)] is None and isinstance(locked.build_model(seed=0), Locked)

    class Odd(torch.nn.Parameter):  # a parameter type that cannot be rebuilt as copy_model rebuilds it
        def __new__(cls, data, requires_grad, scale):
            return super().__new__(cls, data, requires_grad)

    odd = torch.nn.Linear(2, 2)
    odd.weight = Odd(torch.ones(2, 2), True, 1.0)
    shaped = Workload.from_specs(lambda: odd)
    shaped.warm(0)
    assert shaped._found[("model", 0)] is None


def test_warming_a_workload_makes_no_second_copy_of_the_weights(monkeypatch):
    # A 7B model is 28 GB of fp32 weights: warming keeps one build, and checks that it can be copied without a copy
    from autotune.training import workload as module

    copies = []
    monkeypatch.setattr(module, "copy_model", lambda template: copies.append(template) or template)
    warm = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs={"n_layer": 2, "block_size": 16,
                                                                         "n_embd": 32, "n_head": 2, "vocab_size": 64})
    warm.warm(0)
    assert warm._found[("model", 0)] is not None and copies == []
    warm.build_model(seed=0)
    assert len(copies) == 1  # the trial's own copy
