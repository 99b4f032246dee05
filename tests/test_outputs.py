"""``mixprec.models``: one rule for where the loss is in what a model returns."""

from __future__ import annotations

import collections

import pytest
import torch

from mixprec.models import extract_loss, loss_of
from mixprec.tasks import CausalLMOutput
from mixprec.trainer import evaluation, trainer

LOSS = torch.tensor(1.5)


class Answers:
    """Neither a mapping nor an object with .loss: it only answers ["loss"]."""

    def __getitem__(self, key):
        if key != "loss":
            raise KeyError(key)
        return LOSS


@pytest.mark.parametrize("outputs", [
    LOSS,
    {"loss": LOSS, "logits": torch.zeros(2, 3)},
    collections.UserDict(loss=LOSS),
    CausalLMOutput(loss=LOSS, logits=torch.zeros(1, 2, 3)),
    (LOSS, torch.zeros(2, 3)),
    [LOSS],
    Answers(),
], ids=["tensor", "dict", "mapping", "model-output", "tuple", "list", "getitem"])
def test_the_loss_is_found_in_every_shape_a_model_returns(outputs):
    assert extract_loss(outputs) is LOSS and loss_of(outputs) is LOSS


@pytest.mark.parametrize("outputs", [
    torch.zeros(2, 3),  # logits, not a loss
    {"logits": torch.zeros(2)},
    CausalLMOutput(loss=None, logits=torch.zeros(1, 2, 3)),
    (torch.zeros(2, 3), LOSS),  # the loss comes first or not at all
    (),
    "loss",
    None,
    3.0,
], ids=["logits", "dict", "model-output", "tuple", "empty", "str", "none", "number"])
def test_outputs_without_a_loss_give_none_and_loss_of_says_what_to_return(outputs):
    assert extract_loss(outputs) is None
    with pytest.raises(ValueError, match="without a loss; its forward must return a 0-d loss tensor"):
        loss_of(outputs)


def test_the_trainer_reads_the_loss_through_the_same_function():
    assert trainer.extract_loss is extract_loss and evaluation.extract_loss is extract_loss
