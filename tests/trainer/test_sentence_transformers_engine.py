"""sentence-transformers' trainer (a subclass of transformers' Trainer) on mixprec's engine:
``mixprec.patch_transformers()``, then ``SentenceTransformerTrainer`` trains a tiny BERT sentence
encoder, built offline, with MultipleNegativesRankingLoss, in bf16 and in fp16 on the CPU, evaluating
with an evaluator and an eval dataset; the precision asked for is the one in force (fp16 is real fp16,
with its loss scaler); the evaluation loss falls; and a run resumed from its checkpoint at the end of
the first epoch continues from the checkpoint's step to the same losses and weights as the run
uninterrupted (its second epoch in the same order: sentence-transformers shuffles in a batch sampler
of its own, with its own generator, which the seedable sampler must reach). In bf16 the losses are
Accelerate's, step for step."""

from __future__ import annotations

import pytest
import torch

import mixprec

sentence_transformers = pytest.importorskip("sentence_transformers")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from sentence_transformers.sentence_transformer import evaluation, losses, modules  # noqa: E402

WORDS = "the quick brown fox jumps over lazy dog hello world cat sat on mat red blue green yes no good bad".split()


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A tiny BERT and its WordPiece tokenizer, made from a vocabulary written here (nothing downloaded)."""
    path = tmp_path_factory.mktemp("bert")
    (path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    tok = transformers.BertTokenizer(str(path / "vocab.txt"))
    cfg = transformers.BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def rows(n, offset):
    """Anchor/positive pairs: four words, and the same four words and one more."""
    anchors = [" ".join(WORDS[(i * 7 + j * 3 + offset) % len(WORDS)] for j in range(4)) for i in range(n)]
    return datasets.Dataset.from_dict({"anchor": anchors, "positive": [a + " " + WORDS[i % 5] for i, a in
                                                                        enumerate(anchors)]})


def build(out, bert_dir, precision):
    """12 training pairs in batches of 4: 3 steps an epoch, 2 epochs, a checkpoint and an evaluation
    at the end of each."""
    word = modules.Transformer(bert_dir, max_seq_length=16)
    model = sentence_transformers.SentenceTransformer(
        modules=[word, modules.Pooling(word.get_embedding_dimension(), "mean")], device="cpu")
    evals = rows(8, offset=5)
    evaluator = evaluation.EmbeddingSimilarityEvaluator(evals["anchor"], evals["positive"], [1.0, 0.0] * 4, name="sts")
    args = sentence_transformers.SentenceTransformerTrainingArguments(
        output_dir=str(out), max_steps=6, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        learning_rate=2e-3, logging_steps=1, save_steps=3, eval_strategy="steps", eval_steps=3, report_to=[],
        use_cpu=True, disable_tqdm=True, seed=5, **{precision: True})
    return sentence_transformers.SentenceTransformerTrainer(
        model=model, args=args, train_dataset=rows(12, offset=0), eval_dataset=evals,
        loss=losses.MultipleNegativesRankingLoss(model), evaluator=evaluator)


class StartStep(transformers.TrainerCallback):
    """Notes the step ``train()`` starts at (a resumed one: its checkpoint's)."""

    steps: list

    def on_train_begin(self, args, state, control, **kwargs):
        self.steps = [*getattr(self, "steps", []), state.global_step]


def column(trainer, key):
    return [(row["step"], row[key]) for row in trainer.state.log_history if key in row]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_sentence_transformers_trainer_trains_in_the_precision_asked_and_resumes_from_its_checkpoint(
        precision, bert_dir, tmp_path):
    with mixprec.patch_transformers():
        full = build(tmp_path / "full", bert_dir, precision)
        full.train()
        resumed = build(tmp_path / "full", bert_dir, precision)
        start = StartStep()
        resumed.add_callback(start)
        resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))

    acc = full.accelerator
    assert type(acc) is mixprec.Accelerator and type(resumed.accelerator) is mixprec.Accelerator
    report = acc.precision_report()
    assert report.ok, report.violations
    assert report.precision == {"bf16": "bf16-mixed", "fp16": "fp16-mixed"}[precision]
    assert (acc.scaler is not None) == (precision == "fp16")  # fp16 on the CPU is real: autocast and a scaler
    first = next(row for row in full.state.log_history if "loss" in row)
    assert report.precision in first["precision_in_force"]

    evals = column(full, "eval_loss")
    assert [step for step, _ in evals] == [3, 6] and evals[1][1] < evals[0][1]  # it learns
    assert [step for step, _ in column(full, "eval_sts_spearman_cosine")] == [3, 6]  # the evaluator ran

    assert start.steps == [3]  # it resumed at the checkpoint's step, not from the start
    # the second epoch again, from the checkpoint: its order, losses and evaluation, and the weights
    assert column(resumed, "loss")[3:] == column(full, "loss")[3:] and len(column(resumed, "loss")) == 6
    assert column(resumed, "eval_loss") == evals
    theirs, ours = full.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)


def test_in_bf16_the_losses_are_accelerates_step_for_step(bert_dir, tmp_path):
    """bf16 autocasts on the CPU under Accelerate too: the same run on mixprec's engine gives its
    losses (two epochs: the second's order is the seedable sampler's, the same under both)."""
    accelerate_run = build(tmp_path / "accelerate", bert_dir, "bf16")
    accelerate_run.train()
    assert type(accelerate_run.accelerator).__module__.startswith("accelerate")
    with mixprec.patch_transformers():
        ours = build(tmp_path / "mixprec", bert_dir, "bf16")
        ours.train()
    theirs, mine = column(accelerate_run, "loss"), column(ours, "loss")
    assert len(mine) == 6 and [s for s, _ in mine] == [s for s, _ in theirs]
    assert [loss for _, loss in mine] == pytest.approx([loss for _, loss in theirs], rel=1e-4)
