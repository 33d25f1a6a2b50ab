#!/usr/bin/env bash
# The verifier's GPU check, prepared for one short run on a lent CUDA machine (the `device` tool):
#   1. the Triton kernels on CUDA tensors against the torch implementation (identical tokens) and the
#      statistical losslessness tests, on the GPU;
#   2. scripts/bench_verifier.py on CUDA: torch vs Triton vs the per-request loop, with bandwidth.
# Needs only torch, triton and pytest (no conftest: no transformers / pydantic import). Logs go to
# $OUT (the device tool's folder) or outputs/gpu-check/.
#
#   bash scripts/gpu_check.sh            # each step under `timeout`: 9.5 minutes at most, one device call
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=0
out="${OUT:-outputs/gpu-check}"
mkdir -p "$out"
py="${PYTHON:-python3}"
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/gpu.txt"
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())" \
    2>&1 | tee -a "$out/gpu.txt"
timeout 240 "$py" -m pytest -q --noconftest -p no:cacheprovider tests/test_verify_triton.py tests/test_verify.py 2>&1 \
    | tee "$out/tests.log" || status=1
timeout 90 "$py" scripts/bench_verifier.py --device cuda --batch 64 --k 8 --vocab 49152 --temperature 0 1 2>&1 \
    | tee "$out/bench-acceptance.txt" || status=1
timeout 240 "$py" scripts/bench_verifier.py --device cuda --batch 1 8 64 256 --k 1 4 8 16 --vocab 32000 49152 152064 \
    --temperature 0 1 --loop-repeats 2 --repeats 10 2>&1 | tee "$out/bench-grid.txt" || status=1
exit $status
