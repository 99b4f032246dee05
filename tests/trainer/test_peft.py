"""Models wrapped by peft (LoRA) through the Trainer and the Accelerator, with the real peft package.

The columns a ``PeftModel`` takes are its base model's; its checkpoints hold the adapter as
transformers writes them (``adapter_model.safetensors``, ``adapter_config.json``), which resume,
``load_best_model_at_end``, ``save_model`` and ``PeftModel.from_pretrained`` read back; a frozen
fp16 or bf16 base trains in every precision; Accelerate's save/load hooks keep a checkpoint to the
adapter. Differential where cheap: the same LoRA run under transformers' Trainer.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import mixprec
from mixprec import Accelerator, Trainer, TrainingArguments
from mixprec.trainer.datasets import model_input_names

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning"),
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),  # peft's own call
              pytest.mark.usefixtures("one_thread")]


def gpt2(dtype: torch.dtype = torch.float32, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return transformers.GPT2LMHeadModel(cfg).to(dtype)


def lora_lm(dtype: torch.dtype = torch.float32, dropout: float = 0.0) -> torch.nn.Module:
    """A tiny GPT-2 with LoRA on its attention (the same weights at every call)."""
    base = gpt2(dtype, dropout)
    torch.manual_seed(1)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True,
                                                     lora_dropout=dropout, task_type="CAUSAL_LM"))


def bert(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, num_labels=2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg).to(dtype)


def lora_classifier(dtype: torch.dtype = torch.float32, r: int = 16) -> torch.nn.Module:
    """A tiny BERT classifier with LoRA (rank 16: its matrices are Linear layers fp8 can take)."""
    base = bert(dtype)
    torch.manual_seed(1)
    return peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["query", "value"],
                                                     lora_dropout=0.0, task_type="SEQ_CLS"))


def lm_rows(n: int, seed: int = 0) -> list[dict]:
    """Counting sequences mod 64 (learnable), with a text column the model does not take."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        start, step = torch.randint(0, 64, (2,), generator=g).tolist()
        ids = [(start + (step % 5 + 1) * i) % 64 for i in range(16)]
        # The first label, never a target of a causal LM, is -100: transformers' Trainer then divides
        # the summed loss by the same count as the model's mean (it counts the unshifted labels of a
        # model whose loss_type a config leaves unset).
        rows.append({"input_ids": ids, "labels": [-100] + ids[1:], "text": f"counting from {start}"})
    return rows


def cls_rows(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(0, 64, (12,), generator=g)
        rows.append({"input_ids": ids.tolist(), "labels": int(ids[0] < 32), "sentence": "some words", "idx": i})
    return rows


def settings(out: Path, **kw) -> dict:
    base = dict(output_dir=str(out), per_device_train_batch_size=8, per_device_eval_batch_size=8, learning_rate=1e-2,
                max_steps=4, report_to="none", disable_tqdm=True, use_cpu=True, save_strategy="no", logging_steps=1,
                seed=0, train_sampling_strategy="sequential", weight_decay=0.0)
    return {**base, **kw}


def adapter_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items()}


def same_adapter(a: dict, b: dict) -> None:
    """The same adapter tensors, bit for bit (fp32 on one CPU: the runs compared do the same operations)."""
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


class KeysSeen(Trainer):
    """Records the keys of every batch ``compute_loss`` receives."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.keys_seen = getattr(self, "keys_seen", set()) | set(inputs)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


# -- the columns ------------------------------------------------------------------------------
def test_lora_causal_lm_trains_on_its_base_models_columns_and_only_its_adapter_changes(tmp_path):
    """A PeftModel's forward takes **kwargs: the columns are its base model's (transformers' rule),
    so the text column is dropped instead of crashing the collator, and the label names are the
    base model's; the trainable parameters, and the only ones that change, are the adapter's."""
    model = lora_lm()
    assert model_input_names(gpt2())[1] is False  # a transformers model's **kwargs take no columns
    trainer = KeysSeen(model=model, args=TrainingArguments(**settings(tmp_path, max_steps=2)),
                       train_dataset=lm_rows(16))
    assert trainer.label_names == ["labels"]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    assert trainer.keys_seen == {"input_ids", "labels"}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == trainable and all("lora_" in n for n in trainable)
    assert trainer.get_num_trainable_parameters() == sum(before[n].numel() for n in trainable)


def test_label_smoothing_shifts_a_peft_causal_lms_labels_as_transformers_does(tmp_path):
    model = lora_lm()
    trainer = Trainer(model=model, args=TrainingArguments(**settings(tmp_path, label_smoothing_factor=0.1)))
    batch = {"input_ids": torch.tensor([r["input_ids"] for r in lm_rows(4)])}
    batch["labels"] = batch["input_ids"].clone()
    with torch.no_grad():
        ours = trainer.compute_loss(trainer.model_wrapped, transformers.BatchEncoding(batch))
        expected = transformers.trainer_pt_utils.LabelSmoother(0.1)(model(input_ids=batch["input_ids"]),
                                                                    batch["labels"], shift_labels=True)
    assert torch.allclose(ours, expected)


def test_lora_classifier_drops_a_datasets_text_columns_and_trains_the_adapter_and_head(tmp_path):
    datasets = pytest.importorskip("datasets")
    model = lora_classifier(r=4)
    data = datasets.Dataset.from_list(cls_rows(32))
    trainer = KeysSeen(model=model, args=TrainingArguments(**settings(tmp_path, max_steps=3)), train_dataset=data,
                       eval_dataset=data)
    trainer.train()
    assert trainer.keys_seen == {"input_ids", "labels"}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable)  # peft's SEQ_CLS head
    assert "eval_loss" in trainer.evaluate()


# -- checkpoints ------------------------------------------------------------------------------
def test_checkpoints_and_saved_models_hold_the_adapter_which_from_pretrained_reloads(tmp_path):
    model = lora_lm()
    trainer = Trainer(model=model, args=TrainingArguments(**settings(tmp_path, max_steps=2, save_strategy="steps",
                                                                     save_steps=2)), train_dataset=lm_rows(16))
    trainer.train()
    checkpoint = tmp_path / "checkpoint-2"
    files = {p.name for p in checkpoint.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "trainer_state.json"} <= files
    assert not files & {"model_0.safetensors", "model.safetensors", "pytorch_model.bin"}  # the base is not copied
    assert "adapter_model.safetensors" in json.loads((checkpoint / "manifest.json").read_text())["files"]
    trainer.save_model(str(tmp_path / "final"))
    model.save_pretrained(str(tmp_path / "direct"))
    assert {p.name for p in (tmp_path / "final").iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
    assert not (tmp_path / "final" / "model.safetensors").exists()
    x = torch.tensor([r["input_ids"] for r in lm_rows(4, seed=5)])
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=x).logits
        for folder in ("final", "direct", "checkpoint-2"):
            reloaded = peft.PeftModel.from_pretrained(gpt2(), str(tmp_path / folder)).eval()
            assert torch.equal(reloaded(input_ids=x).logits, expected), folder


def test_save_model_without_safetensors_writes_the_adapter_as_a_bin(tmp_path):
    model = lora_lm()
    trainer = Trainer(model=model, args=TrainingArguments(**settings(tmp_path, max_steps=1, save_safetensors=False)),
                      train_dataset=lm_rows(8))
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "adapter_model.bin").is_file() and not (tmp_path / "final" / "pytorch_model.bin").exists()
    same_adapter(adapter_of(peft.PeftModel.from_pretrained(gpt2(), str(tmp_path / "final"))), adapter_of(model))


def best_run(trainer_cls: type, args_cls: type, out: Path):
    model = lora_lm()
    args = args_cls(**settings(out, max_steps=6, learning_rate=0.3, eval_strategy="steps", eval_steps=1,
                               save_strategy="steps", save_steps=1, load_best_model_at_end=True))
    trainer = trainer_cls(model=model, args=args, train_dataset=lm_rows(48), eval_dataset=lm_rows(16, seed=1))
    trainer.train()
    return trainer, adapter_of(model)


def test_load_best_model_at_end_reloads_the_best_adapter_as_transformers_does(tmp_path):
    """The same LoRA run under both Trainers keeps the same best checkpoint (not the last: the
    reload matters) and ends with the same adapter, bit for bit: the best checkpoint's."""
    ours, our_adapter = best_run(Trainer, TrainingArguments, tmp_path / "mp")
    theirs, their_adapter = best_run(transformers.Trainer, transformers.TrainingArguments, tmp_path / "hf")
    best = Path(ours.state.best_model_checkpoint)
    assert best.name == Path(theirs.state.best_model_checkpoint).name != "checkpoint-6"  # the reload matters
    assert ours.state.best_metric == pytest.approx(theirs.state.best_metric, rel=1e-5)
    same_adapter(our_adapter, their_adapter)
    same_adapter(our_adapter, adapter_of(peft.PeftModel.from_pretrained(gpt2(), str(best))))


class ResumeSeen:
    """What a run saw as it began (after any checkpoint was loaded: the step, the adapter) and how many
    optimizer steps it then trained: the proof that a run resumed, which its end alone is not (a run
    started over from the same seed and data order ends on the same adapter)."""

    def __init__(self, lib) -> None:
        seen = self

        class Recorder(lib.TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):
                seen.start_step, seen.start_adapter, seen.steps = state.global_step, adapter_of(model), 0

            def on_step_end(self, args, state, control, **kwargs):
                seen.steps += 1

        self.callback = Recorder()


def resume_run(trainer_cls: type, args_cls: type, out: Path, resume=None, seen: ResumeSeen | None = None):
    model = lora_lm(dropout=0.1)  # dropout: the random state is restored too
    args = args_cls(**settings(out, max_steps=4, save_strategy="steps", save_steps=2))
    trainer_cls(model=model, args=args, train_dataset=lm_rows(48),
                callbacks=[seen.callback] if seen else None).train(resume_from_checkpoint=resume)
    return adapter_of(model)


def resumed_at_the_checkpoint(seen: ResumeSeen, checkpoint: Path) -> None:
    """The run began at the checkpoint's step with its adapter loaded, and trained the 2 steps left."""
    assert (seen.start_step, seen.steps) == (2, 2)
    same_adapter(seen.start_adapter, adapter_of(peft.PeftModel.from_pretrained(gpt2(), str(checkpoint))))


def test_a_resumed_lora_run_starts_from_the_checkpoints_adapter_and_ends_with_an_uninterrupted_runs(tmp_path):
    uninterrupted = resume_run(Trainer, TrainingArguments, tmp_path / "a")
    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")
    seen = ResumeSeen(mixprec)
    same_adapter(resume_run(Trainer, TrainingArguments, tmp_path / "b", resume=True, seen=seen), uninterrupted)
    resumed_at_the_checkpoint(seen, tmp_path / "b" / "checkpoint-2")


def test_lora_checkpoints_go_both_ways_between_transformers_and_mixprec(tmp_path):
    """transformers' adapter-only checkpoint resumes under mixprec, and mixprec's under transformers,
    each starting from the checkpoint's step and adapter and ending where the other trainer's
    uninterrupted run ends (bit for bit)."""
    theirs = resume_run(transformers.Trainer, transformers.TrainingArguments, tmp_path / "hf")
    shutil.copytree(tmp_path / "hf" / "checkpoint-2", tmp_path / "mp" / "checkpoint-2")
    seen = ResumeSeen(mixprec)
    same_adapter(resume_run(Trainer, TrainingArguments, tmp_path / "mp", resume=True, seen=seen), theirs)
    resumed_at_the_checkpoint(seen, tmp_path / "mp" / "checkpoint-2")
    ours = resume_run(Trainer, TrainingArguments, tmp_path / "mp2")
    shutil.copytree(tmp_path / "mp2" / "checkpoint-2", tmp_path / "hf2" / "checkpoint-2")
    seen = ResumeSeen(transformers)
    same_adapter(resume_run(transformers.Trainer, transformers.TrainingArguments, tmp_path / "hf2",
                            resume=str(tmp_path / "hf2" / "checkpoint-2"), seen=seen), ours)
    resumed_at_the_checkpoint(seen, tmp_path / "hf2" / "checkpoint-2")


# -- precision --------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "fp16-mixed", "bf16-mixed", "bf16-true", "fp8"])
@pytest.mark.parametrize("base_dtype", [torch.float16, torch.bfloat16])
def test_a_frozen_half_precision_base_with_fp32_adapters_trains_in_every_precision(tmp_path, base_dtype, precision):
    """A base loaded in fp16 or bf16 (frozen) with peft's fp32 adapters: training changes the
    adapter (and the classifier head peft trains) and nothing else; fp16's loss scaler unscales
    the adapter's gradients beside frozen fp16 weights without any; fp8 converts the LoRA
    matrices it can take (rank 16) and says where each Linear layer stays in bf16."""
    model = lora_classifier(base_dtype)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=model, args=TrainingArguments(**settings(tmp_path, max_steps=3, precision=precision,
                                                                         max_grad_norm=1.0)),
                          train_dataset=cls_rows(24))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}  # as prepared for the precision
        result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in n or "modules_to_save" in n for n in trainable)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable and any("lora_B" in n for n in changed)
    if precision == "fp16-mixed":
        assert trainer.accelerator.scaler is not None and trainer.accelerator.scaler.skipped_steps < 3
    if precision == "fp8":
        layers = trainer.accelerator.precision.layers
        assert any("lora_A" in n and v.startswith("float8") for n, v in layers.items())
        assert all(v.startswith(("float8", "bf16: ")) for v in layers.values())


# -- the Accelerator --------------------------------------------------------------------------
def lora_step(acc: Accelerator, model, opt, rows: list[dict]) -> None:
    batch = {"input_ids": torch.tensor([r["input_ids"] for r in rows])}
    loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
    acc.backward(loss)
    opt.step()
    opt.zero_grad()


def adapter_hooks(acc: Accelerator) -> None:
    """The hooks peft users write (diffusers' training scripts): save and load the adapter alone."""
    def save_hook(models, weights, output_dir):
        if acc.is_main_process:
            for m in models:
                acc.unwrap_model(m).save_pretrained(output_dir)
                weights.pop()

    def load_hook(models, input_dir):
        while models:
            m = acc.unwrap_model(models.pop())
            peft.set_peft_model_state_dict(m, peft.load_peft_weights(input_dir, device="cpu"))

    acc.register_save_state_pre_hook(save_hook)
    acc.register_load_state_pre_hook(load_hook)


def test_accelerator_state_hooks_keep_a_lora_checkpoint_to_the_adapter_and_a_fresh_accelerator_restores_it(tmp_path):
    acc = Accelerator(cpu=True)
    model = lora_lm()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = acc.prepare(model, opt)
    adapter_hooks(acc)
    rows = lm_rows(8)
    lora_step(acc, model, opt, rows)
    acc.save_state(tmp_path / "ckpt")
    saved = adapter_of(acc.unwrap_model(model))
    files = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer_0.bin"} <= files
    assert "model_0.safetensors" not in files
    lora_step(acc, model, opt, rows)
    expected = adapter_of(acc.unwrap_model(model))

    fresh = Accelerator(cpu=True)
    model2 = lora_lm()
    opt2 = torch.optim.AdamW([p for p in model2.parameters() if p.requires_grad], lr=1e-2)
    model2, opt2 = fresh.prepare(model2, opt2)
    adapter_hooks(fresh)
    fresh.load_state(tmp_path / "ckpt")
    same_adapter(adapter_of(fresh.unwrap_model(model2)), saved)
    lora_step(fresh, model2, opt2, rows)
    same_adapter(adapter_of(fresh.unwrap_model(model2)), expected)


def test_fp16_loss_scaler_steps_an_optimizer_holding_frozen_fp16_base_weights_without_gradients():
    """An optimizer built on all of a LoRA model's parameters (the frozen fp16 base among them, which
    get no gradient): fp16-mixed unscales, clips and steps the adapter alone."""
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    model = lora_lm(torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rows = lm_rows(8)
    for _ in range(2):
        batch = torch.tensor([r["input_ids"] for r in rows])
        acc.backward(model(input_ids=batch, labels=batch).loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    assert acc.scaler is not None and acc.scaler.skipped_steps < 2
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" not in n} == {torch.float16}
