#!/usr/bin/env bash
# The expert weight-gradient GEMM's fp32 epilogue through TMA's reduce-add and its experts heaviest
# first (moe/kernels/grouped_wgrad.py) against the earlier load-add-store in index order
# (MOE_WGRAD_EPILOGUE=load MOE_WGRAD_ORDER=index), on one H200 (MOE_GIT_COMMIT=$(git rev-parse HEAD)):
# bench.wgrad --epilogue (each variant bitwise against the earlier kernel first), bench.model at OLMoE
# width (8 layers, micro 4 x accum 4) each way twice back to back, then the Qwen-like `moe train` run each way.
# `wgrad_epilogue.sh qwen`: only the Qwen-like runs.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
step=(--layers 8 --micro 4 --accum 4 --warmup 2 --steps 8)
old=(env MOE_WGRAD_EPILOGUE=load MOE_WGRAD_ORDER=index)
if [ "${1:-}" != qwen ]; then
  run python3 -m bench.wgrad --epilogue --case olmoe --case qwen-like --case qwen-like-collapsed
  for i in 1 2; do
    run python3 -m bench.model "${step[@]}"
    run "${old[@]}" python3 -m bench.model "${step[@]}"
  done
fi
tokens_8k
run python3 -c "from bench.common import matmul_peak_tflops; print(f'bf16 matmul 8192^3 on this GPU: {matmul_peak_tflops():.0f} TFLOP/s')"
qwen_like_train qwen-like-wgrad-reduce-heaviest
MOE_WGRAD_EPILOGUE=load MOE_WGRAD_ORDER=index qwen_like_train qwen-like-wgrad-load-index
exit $status
