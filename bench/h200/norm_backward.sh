#!/usr/bin/env bash
# The RMSNorm backward under torch's fused forward (moe/kernels/rmsnorm.py: our Triton backward against
# torch's own, MOE_NORM_BACKWARD=torch), on one H200 (pass the commit: MOE_GIT_COMMIT=$(git rev-parse HEAD)):
# bench.model at OLMoE width, 8 layers, micro 4 x accum 4, each way twice back to back; then the
# layout-invariant check (DDP, ZeRO-1, FSDP bitwise on one GPU) with the new backward in the loop.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
step=(--layers 8 --micro 4 --accum 4 --warmup 2 --steps 8)
for i in 1 2; do
  run python3 -m bench.model "${step[@]}"
  MOE_NORM_BACKWARD=torch run python3 -m bench.model "${step[@]}"
done
mkdir -p bench/results/layout_invariant
CUBLAS_WORKSPACE_CONFIG=:4096:8 RUN_TIMEOUT=400 run python3 tests/train/layout_invariant_gpu_check.py \
  "bench/results/layout_invariant/ranks-on-one-gpu-norm-backward-$(date -u +%Y%m%dT%H%M%SZ).json"
exit $status
