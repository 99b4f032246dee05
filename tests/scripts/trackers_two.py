"""Two processes log through Accelerator(log_with="tensorboard") (for test_accelerate_dropin.py):

    python -m torch.distributed.run --nproc_per_node 2 trackers_two.py OUT
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mixprec import Accelerator  # noqa: E402

out = Path(sys.argv[1])
acc = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(out))
acc.init_trackers("two", config={"lr": 0.5})
acc.log({"loss": float(acc.process_index + 1)}, step=1)
seen = {"rank": acc.process_index, "trackers": [t.name for t in acc.trackers],
        "placeholder": type(acc.get_tracker("tensorboard")).__name__}
acc.end_training()
os.write(1, ("SEEN " + json.dumps(seen) + "\n").encode())
