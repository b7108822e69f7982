#!/usr/bin/env bash
# The fixed-point kernels of train.layout_invariant on one H200: launch shapes (bench.fixed_point), the FSDP
# flavour of the ranks-sharing-one-GPU check, and a profiled deterministic step to compare with the mode's.
#   MOE_GIT_COMMIT=$(git rev-parse HEAD) bench/h200/fixed_point_kernels.sh
set -uo pipefail
source "$(dirname "$0")/lib.sh"
export CUBLAS_WORKSPACE_CONFIG=:4096:8
run python3 -m bench.fixed_point
mkdir -p bench/results/layout_invariant
FLAVOURS=fsdp RUN_TIMEOUT=400 run python3 tests/train/layout_invariant_gpu_check.py "bench/results/layout_invariant/ranks-on-one-gpu-fsdp-$(date -u +%Y%m%dT%H%M%SZ).json"
run python3 -m bench.model --layers 8 --micro 4 --accum 4 --warmup 2 --steps 3 --deterministic --profile 40
exit $status
