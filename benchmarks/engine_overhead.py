"""What the engine switch costs: trl's ``SFTTrainer`` steps per second with ``mixprec.patch_transformers()``
on and off (Accelerate's Accelerator), bf16, on the same model, data and arguments, interleaved in rounds in
one invocation.

The model is a Llama built from a config (random weights, nothing downloaded) at two sizes: ``tiny``
(2 layers x 64: per-step overhead dominates) and ``small`` (4 layers x 256, sequences of 128 tokens).
The step time is the median interval between consecutive optimizer steps after a warm-up, data
loading and transformers' own loop included; beside it, the training loss each run ends with (the
same seed: the engine must not change the numbers of a precision both run alike).

    .venv/bin/python benchmarks/engine_overhead.py [--steps 40] [--rounds 3] [--sizes tiny,small]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import warnings

import torch

import mixprec

from _common import interleave, median_after_warmup

SIZES = {"tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, length=64),
         "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                       length=128)}
TEXT = ("def train(model, data):\n    for batch in data:\n        loss = model(batch).loss\n        loss.backward()\n"
        "the quick brown fox jumps over the lazy dog; mixed precision keeps what must stay accurate in fp32.\n")


def tokenizer():
    """A byte-level BPE tokenizer trained here on a little text (nothing downloaded)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 50, trainers.BpeTrainer(vocab_size=512, special_tokens=["<pad>", "<eos>", "<unk>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def sft_run(size: str, tok, steps: int, out: str, losses: list[float]) -> list[float]:
    """One SFTTrainer run of ``steps`` steps; the intervals between its optimizer steps."""
    import datasets
    import transformers
    import trl

    shape = dict(SIZES[size])
    length = shape.pop("length")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tok), num_key_value_heads=shape["num_attention_heads"], max_position_embeddings=length,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **shape))
    rows = [TEXT[i % 50:] * 4 for i in range(256)]
    stamps: list[float] = []

    class StepTimes(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    args = trl.SFTConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=8, max_length=length,
                         bf16=True, use_cpu=True, learning_rate=1e-3, lr_scheduler_type="constant",
                         logging_steps=steps, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
                         optim="adamw_torch_fused")
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": rows}),
                             processing_class=tok, callbacks=[StepTimes()])
    trainer.remove_callback(transformers.PrinterCallback)
    result = trainer.train()
    losses.append(result.training_loss)
    return [b - a for a, b in zip(stamps, stamps[1:])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="tiny,small")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    tok, out = tokenizer(), tempfile.mkdtemp()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; trl SFTTrainer, bf16, fused AdamW, "
          f"batch 8; {args.steps} steps per run, {args.rounds} interleaved rounds")
    for size in args.sizes.split(","):
        losses: dict[str, list[float]] = {"Accelerate (switch off)": [], "mixprec (switch on)": []}

        def off(size=size, losses=losses):
            mixprec.unpatch_transformers()
            return sft_run(size, tok, args.steps, out, losses["Accelerate (switch off)"])

        def on(size=size, losses=losses):
            mixprec.patch_transformers()
            try:
                return sft_run(size, tok, args.steps, out, losses["mixprec (switch on)"])
            finally:
                mixprec.unpatch_transformers()

        med = {k: median_after_warmup(v) for k, v in
               interleave({"Accelerate (switch off)": off, "mixprec (switch on)": on}, args.rounds).items()}
        base = med["Accelerate (switch off)"]
        print(f"{size} ({SIZES[size]['num_hidden_layers']} layers x {SIZES[size]['hidden_size']}, "
              f"{SIZES[size]['length']} tokens):")
        for name, v in med.items():
            print(f"  {name:<24} {1 / v:7.2f} steps/s  x{base / v:5.3f}   train loss {statistics.median(losses[name]):.4f}")


if __name__ == "__main__":
    main()
