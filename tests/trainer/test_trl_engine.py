"""trl's trainers (subclasses of transformers' Trainer) on mixprec's engine: ``mixprec.patch_transformers()``,
then trl's SFT, DPO, GRPO, Reward and KTO trainers train a tiny Llama, built offline, in bf16 and in fp16
on the CPU; the precision asked for is the one in force (fp16 is real fp16, with its loss scaler); a run
checkpoints and resumes from its checkpoint to the same losses and weights as the run uninterrupted; and
LoRA through peft inside the SFT trainer trains only the adapter."""

from __future__ import annotations

import pytest
import torch

import mixprec

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

WORDS = ["the quick brown fox", "hello world", "a b c", "lazy dog jumps"]


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE tokenizer trained here on a few sentences (nothing is downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS)] * 20 + [" yes good no bad"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>", "<unk>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>", bos_token="<eos>")


def llama(tok, classifier=False):
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                   bos_token_id=tok.bos_token_id, num_labels=1)
    torch.manual_seed(0)
    return (transformers.LlamaForSequenceClassification if classifier else transformers.LlamaForCausalLM)(cfg)


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    """The tiny Llama saved with its tokenizer: DPO and KTO load their reference model from it."""
    path = tmp_path_factory.mktemp("llama")
    llama(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def reward_length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def build(name, precision, out, tok, model_dir, **more):
    """trl's ``name`` trainer on a tiny dataset: 4 steps of 2 samples, a checkpoint every 2 steps."""
    common = dict(output_dir=str(out), max_steps=4, per_device_train_batch_size=2, logging_steps=1, save_steps=2,
                  report_to=[], use_cpu=True, disable_tqdm=True, seed=5, **{precision: True}, **more)
    if name == "sft":
        data = datasets.Dataset.from_dict({"text": [a + " " + b for a in WORDS for b in WORDS]})
        return trl.SFTTrainer(model=llama(tok), args=trl.SFTConfig(max_length=32, **common), train_dataset=data,
                              processing_class=tok)
    if name == "dpo":
        data = datasets.Dataset.from_dict({"prompt": WORDS * 2, "chosen": [" yes good"] * 8, "rejected": [" no bad"] * 8})
        return trl.DPOTrainer(model=model_dir, args=trl.DPOConfig(max_length=32, **common), train_dataset=data,
                              processing_class=tok)
    if name == "kto":
        data = datasets.Dataset.from_dict({"prompt": WORDS * 2, "completion": [" yes good", " no bad"] * 4,
                                           "label": [True, False] * 4})
        return trl.KTOTrainer(model=model_dir, args=trl.KTOConfig(max_length=32, **common), train_dataset=data,
                              processing_class=tok)
    if name == "reward":
        data = datasets.Dataset.from_dict({"chosen": [w + " yes good" for w in WORDS] * 2,
                                           "rejected": [w + " no bad" for w in WORDS] * 2})
        return trl.RewardTrainer(model=llama(tok, classifier=True), args=trl.RewardConfig(max_length=32, **common),
                                 train_dataset=data, processing_class=tok)
    data = datasets.Dataset.from_dict({"prompt": WORDS * 2})
    config = trl.GRPOConfig(max_completion_length=6, num_generations=2, generation_batch_size=4, **common)
    return trl.GRPOTrainer(model=llama(tok), reward_funcs=reward_length, args=config, train_dataset=data,
                           processing_class=tok)


class StartStep(transformers.TrainerCallback):
    """Notes the step ``train()`` starts at (a resumed one: its checkpoint's)."""

    steps: list

    def on_train_begin(self, args, state, control, **kwargs):
        self.steps = [*getattr(self, "steps", []), state.global_step]


def losses(trainer):
    return [(row["step"], row["loss"]) for row in trainer.state.log_history if "loss" in row]


@pytest.fixture
def switch():
    yield mixprec.patch_transformers()
    mixprec.unpatch_transformers()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["sft", "dpo", "grpo", "reward", "kto"])
def test_trl_trainer_trains_in_the_precision_asked_and_resumes_from_its_checkpoint(
        name, precision, tokenizer, model_dir, tmp_path, switch):
    full = build(name, precision, tmp_path / "full", tokenizer, model_dir)
    full.train()
    acc = full.accelerator
    assert type(acc) is mixprec.Accelerator
    report = acc.precision_report()
    assert report.ok, report.violations
    assert report.precision == {"bf16": "bf16-mixed", "fp16": "fp16-mixed"}[precision]
    assert (acc.scaler is not None) == (precision == "fp16")  # fp16 on the CPU is real: autocast and a scaler
    first = next(row for row in full.state.log_history if "loss" in row)
    assert "precision_in_force" in first and report.precision in first["precision_in_force"]

    resumed = build(name, precision, tmp_path / "full", tokenizer, model_dir)
    start = StartStep()
    resumed.add_callback(start)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert start.steps == [2]  # it resumed, not started over
    assert losses(resumed) == losses(full)  # steps 3 and 4 again, from the checkpoint, to the same losses
    theirs, ours = full.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)


def test_lora_inside_trls_sft_trainer_trains_only_the_adapter(tokenizer, model_dir, tmp_path, switch):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    data = datasets.Dataset.from_dict({"text": [a + " " + b for a in WORDS for b in WORDS]})
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, logging_steps=1,
                         save_steps=4, report_to=[], use_cpu=True, disable_tqdm=True, bf16=True, max_length=32,
                         learning_rate=1e-2)
    trainer = trl.SFTTrainer(model=llama(tokenizer), args=args, train_dataset=data, processing_class=tokenizer,
                             peft_config=config)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    after = trainer.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)
    assert trainer.accelerator.precision_report().ok
    saved = tmp_path / "checkpoint-4"
    assert (saved / "adapter_model.safetensors").exists() and not (saved / "model.safetensors").exists()
