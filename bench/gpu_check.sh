#!/usr/bin/env bash
# The CUDA check, in order of what matters most, each step under its own time limit so that
# one slow step cannot hide the others' results (about 8 minutes in all):
#   1. the CUDA-only tests: graph capture and replay, variable-length prefill;
#   2. bench/engine.py part h in bfloat16 on a random-weight checkpoint with SmolLM2-135M's
#      shapes (the embedded GGUF is too big to travel to the GPU machine): prefill with one
#      varlen FlashAttention call a layer against one SDPA call a request;
#   3. the other model and engine tests with the engine on the GPU (the host-tier tests among
#      them load pages on the copy stream layer by layer; decode steps replay CUDA graphs);
#   4. parts a and c on the same checkpoint; part c runs eager and with CUDA graphs side by side;
#   5. decode rates and part h on a random-weight Llama-3.2-1B-shaped checkpoint;
#   6. with WITH_COMPILE=1, part c with --compile: CUDA graphs of the compiled step.
# Run from the repository root after the README's set-up, on a machine with a CUDA GPU:
#   bash bench/gpu_check.sh            (PY=python3 to use another interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${WORK:-$(mktemp -d)}
step() { echo; echo "== $(date +%T) $*"; }
run() { # run LIMIT_S CMD...: report the exit status, go on either way
    local limit=$1
    shift
    timeout "$limit" "$@"
    echo "-- exit $?"
}
export PYTHONUNBUFFERED=1
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.__version__, torch.cuda.get_device_name(0))" || exit 1
step "1. the CUDA-only tests: graph capture and variable-length prefill"
export RADIXSERVE_TEST_DEVICE=cuda
run 60 "$PY" -m pytest -q -p no:cacheprovider tests/model/test_cuda_graph.py \
    tests/model/test_varlen.py
unset RADIXSERVE_TEST_DEVICE
step "2. random SmolLM2-135M shapes, bfloat16, part h (varlen prefill against the loop)"
"$PY" bench/random_checkpoint.py smollm2-135m "$WORK/smollm2" 2>/dev/null
run 60 "$PY" bench/engine.py --device cuda --dtype bfloat16 --model "$WORK/smollm2" --parts h
step "3. the other tests/model on cuda (AOT is CPU-only)"
export RADIXSERVE_TEST_DEVICE=cuda
run 200 "$PY" -m pytest -q -p no:cacheprovider tests/model --ignore tests/model/test_aot.py \
    --deselect tests/model/test_cuda_graph.py --deselect tests/model/test_varlen.py
unset RADIXSERVE_TEST_DEVICE
step "4. SmolLM2-135M shapes, parts a,c (eager and CUDA graphs)"
run 90 "$PY" bench/engine.py --device cuda --dtype bfloat16 --model "$WORK/smollm2" --parts a,c
step "5. random Llama-3.2-1B shapes, bfloat16, parts c,h"
"$PY" bench/random_checkpoint.py llama-3.2-1b "$WORK/llama1b" 2>/dev/null
run 70 "$PY" bench/engine.py --device cuda --dtype bfloat16 --model "$WORK/llama1b" --parts c,h \
    --repeats 2
if [ -n "${WITH_COMPILE:-}" ]; then
    step "6. SmolLM2-135M shapes, part c with --compile (CUDA graphs of the compiled step)"
    run 80 "$PY" bench/engine.py --device cuda --dtype bfloat16 --model "$WORK/smollm2" \
        --parts c --compile
fi
step done
