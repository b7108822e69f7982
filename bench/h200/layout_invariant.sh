#!/usr/bin/env bash
# What train.layout_invariant costs on one H200 (issue 53), and that it holds on CUDA:
# 1. the fixed-point Triton kernels bitwise against the torch path (tests/kernels/fixed_point_check.py);
# 2. dp = 4, 2, 1 ranks sharing the GPU over gloo, DDP/ZeRO-1/FSDP, and resumes 4 -> 2 -> 1, bitwise
#    (tests/train/layout_invariant_gpu_check.py; JSON in bench/results/layout_invariant/);
# 3. bench.model at OLMoE width, 8 layers, micro 4 x accum 4: the default mode against train.deterministic
#    and train.layout_invariant (each run its own process; step time and peak memory in the JSON), the
#    layout-invariant run twice (its losses must be equal), then once with a profiled step.
#   MOE_GIT_COMMIT=$(git rev-parse HEAD) bench/h200/layout_invariant.sh
set -uo pipefail
source "$(dirname "$0")/lib.sh"
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # what the deterministic mode needs before cuBLAS starts
run python3 tests/kernels/fixed_point_check.py
step=(--layers 8 --micro 4 --accum 4 --warmup 2 --steps 8)
run python3 -m bench.model "${step[@]}"
run python3 -m bench.model "${step[@]}" --deterministic
run python3 -m bench.model "${step[@]}" --layout-invariant
run python3 -m bench.model "${step[@]}" --layout-invariant
run python3 -m bench.model "${step[@]}" --deterministic
[ "${PROFILE:-1}" = 1 ] && run python3 -m bench.model "${step[@]}" --layout-invariant --steps 3 --profile 25
mkdir -p bench/results/layout_invariant
RUN_TIMEOUT=900 run python3 tests/train/layout_invariant_gpu_check.py "bench/results/layout_invariant/ranks-on-one-gpu-$(date -u +%Y%m%dT%H%M%SZ).json"
exit $status
