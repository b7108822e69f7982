#!/usr/bin/env bash
# The expert weight-gradient GEMM (moe/kernels/grouped_wgrad.py) with its experts heaviest first
# against index order (MOE_WGRAD_ORDER=index), on one H200 (MOE_GIT_COMMIT=$(git rev-parse HEAD)):
# bench.wgrad --orders (heaviest first checked bitwise against index order first), bench.model at
# OLMoE width (8 layers, micro 4 x accum 4) each way twice back to back, the Qwen-like `moe train`
# run each way, then the layout-invariant check (DDP, ZeRO-1, FSDP bitwise on one GPU).
# `wgrad_order.sh qwen`: only the Qwen-like runs.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
step=(--layers 8 --micro 4 --accum 4 --warmup 2 --steps 8)
if [ "${1:-}" != qwen ]; then
  run python3 -m bench.wgrad --orders --case olmoe --case qwen-like --case qwen-like-collapsed
  for i in 1 2; do
    run python3 -m bench.model "${step[@]}"
    run env MOE_WGRAD_ORDER=index python3 -m bench.model "${step[@]}"
  done
fi
tokens_8k
run python3 -c "from bench.common import matmul_peak_tflops; print(f'bf16 matmul 8192^3 on this GPU: {matmul_peak_tflops():.0f} TFLOP/s')"
qwen_like_train qwen-like-wgrad-heaviest-first
MOE_WGRAD_ORDER=index qwen_like_train qwen-like-wgrad-index-order
if [ "${1:-}" != qwen ]; then
  mkdir -p bench/results/layout_invariant
  CUBLAS_WORKSPACE_CONFIG=:4096:8 RUN_TIMEOUT=240 run python3 tests/train/layout_invariant_gpu_check.py \
    "bench/results/layout_invariant/ranks-on-one-gpu-wgrad-order-$(date -u +%Y%m%dT%H%M%SZ).json"
fi
exit $status
