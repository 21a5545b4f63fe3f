#!/usr/bin/env bash
# GPU check for a session lent an NVIDIA GPU (see benchmarks/README.md, "GPU check").
#
#   bash benchmarks/gpu_check.sh                    # on the GPU machine, from anywhere
#   bash benchmarks/gpu_check.sh --dry-run          # here, on the CPU: tiny sizes, code paths only
#
# Runs from the working tree (PYTHONPATH=., nothing installed; python3 or $PYTHON), needs torch
# and transformers 5 (the GPU image has torch 2.11, transformers 5.17) and pytest. Steps:
#   1. the model: $MINISGL_GPU_MODEL, else models/SmolLM2-135M-Instruct, else a seeded random
#      stand-in with SmolLM2's shapes written to models/smollm2-shaped-random (the GPU machine
#      has no network and the real model does not fit in what can be carried there);
#   2. tests/test_gpu.py and tests/test_fi_metadata.py (pytest, -rs: skips are listed);
#   3. benchmarks/gpu_check.py bench: decode step at batch 1/4/16/64 in bfloat16 beside HF and
#      the HBM roofline, as Markdown.
# Each step has its own time limit; the whole script stays under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && ! "$PY" -c "import torch" 2>/dev/null && PY=.venv/bin/python
# pyproject.toml's addopts need pytest-socket, which the GPU image lacks (it has no network anyway)
PYTEST=("$PY" -m pytest -o addopts=-ra -p no:cacheprovider)
start=$SECONDS
status=0

if [ "${1:-}" = "--dry-run" ]; then
  echo "## DRY RUN (CPU): GPU tests as the CPU sees them, then the benchmark with tiny sizes"
  timeout 120 "${PYTEST[@]}" tests/test_gpu.py -q -rs || status=$?
  timeout 300 "$PY" benchmarks/gpu_check.py bench --device cpu --dry-run || status=$?
  echo "(dry run: exit $status, $((SECONDS - start)) s)"
  exit $status
fi

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "no CUDA device visible to torch: nothing to check (use --dry-run on a CPU)"; exit 2; }
"$PY" -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__, '|', torch.cuda.get_device_name())"

MODEL=${MINISGL_GPU_MODEL:-models/SmolLM2-135M-Instruct}
if [ ! -f "$MODEL/config.json" ]; then
  MODEL=models/smollm2-shaped-random
  timeout 120 "$PY" benchmarks/gpu_check.py standin --out "$MODEL" || exit 1
fi
export MINISGL_GPU_MODEL=$MODEL
echo "model: $MODEL"

echo "## tests/test_gpu.py, tests/test_fi_metadata.py"
timeout 240 "${PYTEST[@]}" tests/test_gpu.py tests/test_fi_metadata.py -q -rs -s \
  2>&1 | grep -v "Loading weights" || status=1
echo
timeout 180 "$PY" benchmarks/gpu_check.py bench --model "$MODEL" || status=1
echo "(gpu_check: exit $status, $((SECONDS - start)) s)"
exit $status
