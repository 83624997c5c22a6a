"""A warm model's copies (autotune.training.copies): new tensors of the same values, tied parameters still tied, and
the build's random draws replayed."""

import random

import torch

from autotune.training.copies import RandomStates, copy_model, copyable


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight  # tied, as a language model's head and embedding are
        self.norm = torch.nn.BatchNorm1d(4)


def test_a_copy_holds_new_tensors_of_the_same_values_and_keeps_ties():
    template = Tied()
    copied = copy_model(template)
    assert copied.head.weight is copied.embed.weight  # still one parameter
    for (name, mine), theirs in zip(copied.state_dict().items(), template.state_dict().values()):
        assert torch.equal(mine, theirs) and mine.data_ptr() != theirs.data_ptr(), name
    assert isinstance(copied.embed.weight, torch.nn.Parameter) and copied.embed.weight.requires_grad
    assert copyable(template)


def test_the_random_states_put_every_generator_back():
    states = RandomStates.now()
    drawn = (torch.rand(3), random.random())
    torch.rand(5), random.random()  # the draws move on
    states.restore()
    again = (torch.rand(3), random.random())
    assert torch.equal(drawn[0], again[0]) and drawn[1] == again[1]
