"""mixprec's weight-decay groups are transformers': ``decay_parameter_names`` states the rule of
transformers' ``Trainer.get_decay_parameter_names`` (rather than importing transformers' Trainer
for it), and here the two give the same parameters on transformers' own models and on plain
modules, against the installed transformers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.trainer.schedules import decay_parameter_names

transformers = pytest.importorskip("transformers", reason="the reference: pip install transformers")


class _NormWithChild(nn.LayerNorm):
    """A LayerNorm subclass holding a module of its own: its parameters are in a LayerNorm too."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.gate = nn.Linear(n, n)


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 8, bias=False))
        self.final_norm = nn.RMSNorm(8)
        self.norm = _NormWithChild(8)
        self.normalizer = nn.Linear(8, 8)  # "norm" only as a word's start: decayed
        self.scale = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(8, 10)
        self.head.weight = self.embed.weight  # tied: one parameter, two names


def _models():
    cfg = dict(vocab_size=64, num_hidden_layers=2, num_attention_heads=2, hidden_size=16, intermediate_size=32)
    yield "gpt2", transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_layer=2, n_head=2, n_embd=16))
    yield "llama", transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, num_key_value_heads=1))
    yield "bert", transformers.BertForSequenceClassification(transformers.BertConfig(**cfg))
    yield "t5", transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2))
    yield "plain", _Plain()


@pytest.mark.parametrize("name,model", list(_models()), ids=lambda v: v if isinstance(v, str) else "")
def test_the_decay_parameters_are_transformers_trainers(name, model):
    from transformers import Trainer

    named = [n for n, _ in model.named_parameters()]  # what the optimizer's groups are built from
    theirs = set(Trainer.get_decay_parameter_names(None, model)) & set(named)
    ours = decay_parameter_names(model)
    assert set(ours) == theirs
    assert len(ours) == len(set(ours)) and 0 < len(ours) < len(named)  # both groups hold something
