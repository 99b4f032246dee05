"""transformers' own Trainer on a 2-layer GPT-2 (a byte-level model of a standard-library module's
source), restarted as transformers' example scripts restart it, for the engine's checkpoint tests
(tests/trainer/test_engine_checkpoints.py); one process, or several under torchrun:

    python engine_run.py OUT PRECISION [--stock] [--trl] [--kill-in-save STEP] [--sigterm-at STEP]
                         [--rank R] [--save-total-limit N]

PRECISION is fp32, bf16 or fp16 (the TrainingArguments' flags). Without ``--stock`` the switch is
on (``mixprec.patch_transformers()``). The run resumes from ``get_last_checkpoint(OUT)``, saving
every 2 steps. ``--kill-in-save STEP`` SIGKILLs process ``--rank`` (default 0) in the middle of the
save at STEP, after the weights are written and before the optimizer's state; ``--sigterm-at
STEP`` sends it SIGTERM as step STEP begins. A run that ends writes OUT/result-<rank>.json: the
losses by step and the weights; one that exits with ``SystemExit`` writes OUT/exit-<rank>.json
(its status, its step and the checkpoint it resumed from). ``--trl`` trains with trl's SFTTrainer instead.
"""

import argparse
import inspect
import json
import os
import signal
import sys

import torch
import transformers
from transformers.trainer_utils import get_last_checkpoint

torch.set_num_threads(1)  # one thread: the same kernels' reduction order in every run, whatever else runs

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("precision", choices=["fp32", "bf16", "fp16"])
p.add_argument("--stock", action="store_true")
p.add_argument("--trl", action="store_true")
p.add_argument("--kill-in-save", type=int)
p.add_argument("--sigterm-at", type=int)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--save-total-limit", type=int, default=2)
p.add_argument("--max-steps", type=int, default=12)
a = p.parse_args()
if not a.stock:
    import mixprec

    mixprec.patch_transformers()
rank = int(os.environ.get("RANK", "0"))

SEQ = 16
text = inspect.getsource(json.decoder).encode()
rows = torch.tensor(list(text[: (len(text) // SEQ) * SEQ]), dtype=torch.long).reshape(-1, SEQ)[:64]


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return len(rows)

    def __getitem__(self, i):
        return {"input_ids": rows[i], "labels": rows[i]}


class Faults(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if a.sigterm_at is not None and state.global_step + 1 == a.sigterm_at and rank == a.rank:
            os.kill(os.getpid(), signal.SIGTERM)


original = transformers.Trainer._save_optimizer_and_scheduler


def save_optimizer_and_scheduler(self, output_dir):
    if self.state.global_step == a.kill_in_save and rank == a.rank:
        os.kill(os.getpid(), signal.SIGKILL)  # the weights are written, the optimizer's state is not
    return original(self, output_dir)


transformers.Trainer._save_optimizer_and_scheduler = save_optimizer_and_scheduler

torch.manual_seed(0)
config = transformers.GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2)
model = transformers.GPT2LMHeadModel(config)
settings = dict(output_dir=a.out, per_device_train_batch_size=4, max_steps=a.max_steps, save_steps=2,
                save_total_limit=a.save_total_limit, logging_steps=1, report_to="none", disable_tqdm=True,
                use_cpu=True, seed=1, learning_rate=3e-3, fp16=a.precision == "fp16", bf16=a.precision == "bf16")
if a.trl:
    import datasets
    import trl
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))  # byte-level BPE trained here on the same source
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator([text.decode()], trainers.BpeTrainer(vocab_size=256, special_tokens=["<pad>", "<eos>", "<unk>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>",
                                               unk_token="<unk>")
    model.config.pad_token_id, model.config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    lines = [line for line in text.decode().splitlines() if len(line) > 20][:64]
    args = trl.SFTConfig(**settings, max_length=SEQ)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": lines}),
                             processing_class=tok, callbacks=[Faults()])
else:
    args = transformers.TrainingArguments(**settings)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[Faults()])
last = get_last_checkpoint(a.out) if os.path.isdir(a.out) else None
try:
    trainer.train(resume_from_checkpoint=last)
except SystemExit as e:  # a preempted run: which status, at which step, on this rank
    with open(os.path.join(a.out, f"exit-{rank}.json"), "w") as f:
        json.dump({"code": e.code, "step": trainer.state.global_step, "resumed_from": last}, f)
    raise
result = {"resumed_from": last, "losses": [[r["step"], r["loss"]] for r in trainer.state.log_history if "loss" in r],
          "weights": {k: v.float().reshape(-1).tolist() for k, v in trainer.model.state_dict().items()}}
with open(os.path.join(a.out, f"result-{rank}.json"), "w") as f:
    json.dump(result, f)
sys.exit(0)
