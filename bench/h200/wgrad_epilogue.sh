#!/usr/bin/env bash
# The expert weight-gradient GEMM (moe/kernels/grouped_wgrad.py) with its operands through one
# descriptor each and its experts heaviest first, against descriptors per tile (MOE_WGRAD_OPERANDS=per-tile)
# and the earlier kernel (per tile, index order: + MOE_WGRAD_ORDER=index), on one H200
# (MOE_GIT_COMMIT=$(git rev-parse HEAD)): bench.wgrad --epilogue (each variant bitwise against the
# earlier kernel first), bench.model at OLMoE width (8 layers, micro 4 x accum 4) each way twice,
# then the Qwen-like `moe train` run each way. `wgrad_epilogue.sh qwen`: only the Qwen-like runs.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
step=(--layers 8 --micro 4 --accum 4 --warmup 2 --steps 8)
per_tile=(env MOE_WGRAD_OPERANDS=per-tile)
earlier=(env MOE_WGRAD_OPERANDS=per-tile MOE_WGRAD_ORDER=index)
if [ "${1:-}" != qwen ]; then
  run python3 -m bench.wgrad --epilogue --case olmoe --case qwen-like --case qwen-like-collapsed
  for i in 1 2; do
    run python3 -m bench.model "${step[@]}"
    run "${per_tile[@]}" python3 -m bench.model "${step[@]}"
    run "${earlier[@]}" python3 -m bench.model "${step[@]}"
  done
fi
tokens_8k
run python3 -c "from bench.common import matmul_peak_tflops; print(f'bf16 matmul 8192^3 on this GPU: {matmul_peak_tflops():.0f} TFLOP/s')"
qwen_like_train qwen-like-wgrad-whole-heaviest
MOE_WGRAD_OPERANDS=per-tile qwen_like_train qwen-like-wgrad-per-tile-heaviest
MOE_WGRAD_OPERANDS=per-tile MOE_WGRAD_ORDER=index qwen_like_train qwen-like-wgrad-per-tile-index
exit $status
