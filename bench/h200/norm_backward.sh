#!/usr/bin/env bash
# The RMSNorm backward under torch's fused forward (moe/kernels/rmsnorm.py: our Triton backward against
# torch's own, MOE_NORM_BACKWARD=torch), on one H200 (pass the commit: MOE_GIT_COMMIT=$(git rev-parse HEAD)):
# bench.model at OLMoE width, 8 layers, micro 4 x accum 4, each way twice back to back; then the
# layout-invariant check (DDP, ZeRO-1, FSDP bitwise on one GPU) with the new backward in the loop.
# `norm_backward.sh qwen`: the Qwen-like `moe train` run each way instead.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
step=(--layers 8 --micro 4 --accum 4 --warmup 2 --steps 8)
if [ "${1:-}" = qwen ]; then  # the Qwen3-30B-A3B-like shape through `moe train` (as step_speed.sh qwen), each way
  tokens_8k
  run python3 -c "from bench.common import matmul_peak_tflops; print(f'bf16 matmul 8192^3 on this GPU: {matmul_peak_tflops():.0f} TFLOP/s')"
  for backward in triton torch; do
    export MOE_NORM_BACKWARD=$backward
    qwen_like_train qwen-like-norm-backward-$backward
  done
  unset MOE_NORM_BACKWARD
  exit $status
fi
for i in 1 2; do
  run python3 -m bench.model "${step[@]}"
  MOE_NORM_BACKWARD=torch run python3 -m bench.model "${step[@]}"
done
mkdir -p bench/results/layout_invariant
CUBLAS_WORKSPACE_CONFIG=:4096:8 RUN_TIMEOUT=400 run python3 tests/train/layout_invariant_gpu_check.py \
  "bench/results/layout_invariant/ranks-on-one-gpu-norm-backward-$(date -u +%Y%m%dT%H%M%SZ).json"
exit $status
