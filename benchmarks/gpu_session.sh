#!/usr/bin/env bash
# The GPU checks of a session lent a CUDA machine (the `device` tool): one prepared run.
# Usage there:  OUT=<folder> bash benchmarks/gpu_session.sh [probe|full|llama]
# llama (issue 40, part 3): benchmarks/llama_1b.py alone, compiled then eager, under 9 minutes in all;
# run it with the device tool's timeout_s=600. It needs transformers and accelerate on the machine.
# Installs nothing from the network: mixprec from this checkout (PYTHONPATH), torchao from the
# wheels carried in .whl/ when present. Figures go to $OUT; copy them into benchmarks/RESULTS.md.
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
what=${1:-full}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
  python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1
  python3 -c "import accelerate, transformers; print('accelerate', accelerate.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"

if [ "$what" = llama ]; then
  if ! python3 -c "import transformers, accelerate" 2>/dev/null; then
    echo "llama: transformers and accelerate are not importable here; carry their wheels, and their dependencies', in .whl/" | tee "$OUT/llama.txt"
    exit 1
  fi
  echo "== llama 1B: hand loop, mixprec (bf16-mixed, fp8, bf16-true), Accelerate; compiled"
  timeout 330 python3 benchmarks/llama_1b.py --compile --budget-s 270 \
    --jobs torch:bf16,mixprec:bf16-mixed,mixprec:fp8,accelerate:bf16,mixprec:bf16-true \
    --out "$OUT/llama_compiled" 2>&1 | tee "$OUT/llama_compiled.log" | tail -25
  echo "== llama 1B: the same, eager"
  timeout 180 python3 benchmarks/llama_1b.py --budget-s 120 --out "$OUT/llama_eager" 2>&1 | tee "$OUT/llama_eager.log" | tail -25
  exit 0
fi

echo "== CUDA tests"
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"

if [ "$what" = probe ]; then
  echo "== fp8 probe"
  timeout 120 python3 benchmarks/fp8_linear_probe.py 2>&1 | tail -30 | tee "$OUT/fp8_probe.txt"
  echo "== bench (short)"
  timeout 150 python3 -m mixprec.cli bench --device cuda --task pycode --size small --batch-size 64 \
    --steps 10 --rounds 2 --out "$OUT/bench" 2>&1 | tail -30 | tee "$OUT/bench.txt"
  exit 0
fi

echo "== bench: pycode small, bf16-mixed against fp8, compiled"
timeout 170 python3 -m mixprec.cli bench --device cuda --task pycode --size small --batch-size 64 \
  --precisions bf16-mixed,fp8 --compile --steps 10 --rounds 3 --out "$OUT/small" 2>&1 | tail -14 | tee "$OUT/bench_small.txt"
echo "== bench: a GPT of width 2048 (benchmarks/gpt_wide.py), bf16-mixed against fp8, compiled"
PYTHONPATH=$PYTHONPATH:$PWD/benchmarks timeout 220 python3 -m mixprec.cli bench --device cuda \
  --model gpt_wide:build_model --data gpt_wide:build_data --batch-size 16 \
  --precisions bf16-mixed,fp8 --compile --steps 10 --rounds 2 --out "$OUT/wide" 2>&1 | tail -14 | tee "$OUT/bench_wide.txt"
