"""transformers' own Trainer under torchrun (2 gloo processes), on Accelerate or, after
``mixprec.patch_transformers()``, on mixprec (for tests/trainer/test_engine_ddp.py):

    python -m torch.distributed.run --nproc_per_node 2 engine_ddp.py accelerate|mixprec OUT_DIR

Each process writes OUT_DIR/<rank>.json: its logs, its weights after training, whether the model
trained wrapped in DistributedDataParallel, and its Accelerator's class.
"""

import json
import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from toys import SineRegressor, SineRows  # noqa: E402

lib, out = sys.argv[1], sys.argv[2]
if lib == "mixprec":
    import mixprec

    mixprec.patch_transformers()

args = transformers.TrainingArguments(output_dir=out, num_train_epochs=2, per_device_train_batch_size=4,
                                      learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none",
                                      disable_tqdm=True, use_cpu=True, seed=3, eval_strategy="epoch",
                                      per_device_eval_batch_size=6)
torch.manual_seed(0)
trainer = transformers.Trainer(model=SineRegressor(), args=args, train_dataset=SineRows(), eval_dataset=SineRows())
trainer.train()
record = {"logs": trainer.state.log_history, "ddp": isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel),
          "accelerator": type(trainer.accelerator).__module__,
          "weights": [round(float(v), 7) for p in trainer.model.parameters() for v in p.detach().reshape(-1)]}
rank = trainer.args.process_index
with open(os.path.join(out, f"{rank}.json"), "w") as f:
    json.dump(record, f, default=str)
trainer.accelerator.wait_for_everyone()
