#!/usr/bin/env bash
# The CUDA check, in order of what matters most, each step under its own time limit so that
# one slow step cannot hide the others' results:
#   1. the model and engine tests with the engine on the GPU (the host-tier tests among them
#      load pages on the copy stream layer by layer; decode steps replay CUDA graphs);
#   2. bench/engine.py parts a and c in bfloat16 on a random-weight checkpoint with
#      SmolLM2-135M's shapes (the embedded GGUF is too big to travel to the GPU machine);
#      part c runs eager and with CUDA graphs side by side;
#   3. decode rates and the roofline on a random-weight Llama-3.2-1B-shaped checkpoint;
#   4. part c with --compile: CUDA graphs of the compiled step.
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
step "1. tests/model on cuda (AOT is CPU-only)"
export RADIXSERVE_TEST_DEVICE=cuda
run 60 "$PY" -m pytest -q -p no:cacheprovider tests/model/test_cuda_graph.py
run 150 "$PY" -m pytest -q -p no:cacheprovider tests/model --ignore tests/model/test_aot.py \
    --deselect tests/model/test_cuda_graph.py
unset RADIXSERVE_TEST_DEVICE
step "2. random SmolLM2-135M shapes, bfloat16, parts a,c (eager and CUDA graphs)"
"$PY" bench/random_checkpoint.py smollm2-135m "$WORK/smollm2" 2>/dev/null
run 90 "$PY" bench/engine.py --device cuda --dtype bfloat16 --model "$WORK/smollm2" --parts a,c
step "3. random Llama-3.2-1B shapes, bfloat16, parts c,d"
"$PY" bench/random_checkpoint.py llama-3.2-1b "$WORK/llama1b" 2>/dev/null
run 70 "$PY" bench/engine.py --device cuda --dtype bfloat16 --model "$WORK/llama1b" --parts c,d
step "4. SmolLM2-135M shapes, part c with --compile (CUDA graphs of the compiled step)"
run 80 "$PY" bench/engine.py --device cuda --dtype bfloat16 --model "$WORK/smollm2" --parts c \
    --compile
step done
