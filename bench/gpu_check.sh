#!/usr/bin/env bash
# The CUDA check: the correctness tests with the engine on the GPU (tests/model includes the
# host-tier tests, whose loads then run on the copy stream layer by layer and must give the
# outputs of an engine without a cache), then benchmark (a) in bfloat16. Run on a machine with a CUDA GPU, from the repository root, after the README's
# set-up:  bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
RADIXSERVE_TEST_DEVICE=cuda "$PY" -m pytest -q tests/model
"$PY" bench/engine.py --device cuda --dtype bfloat16 --parts a,c
