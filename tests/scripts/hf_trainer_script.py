"""A user's training script written for transformers' Trainer, untouched (for tests/cli/test_cli_run.py):
three steps, fp16 as its arguments say; prints which Accelerator trained it and in what precision.

    python hf_trainer_script.py OUT_DIR
"""

import os
import sys

import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from toys import SineRegressor, SineRows  # noqa: E402

if __name__ == "__main__":
    args = transformers.TrainingArguments(output_dir=sys.argv[1], max_steps=3, per_device_train_batch_size=4,
                                          logging_steps=1, report_to="none", disable_tqdm=True, use_cpu=True,
                                          fp16=True, save_strategy="no")
    trainer = transformers.Trainer(model=SineRegressor(), args=args, train_dataset=SineRows())
    trainer.train()
    print("TRAINED", type(trainer.accelerator).__module__, trainer.accelerator.mixed_precision,
          "precision_in_force" in trainer.state.log_history[0], flush=True)
