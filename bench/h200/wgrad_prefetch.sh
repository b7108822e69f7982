#!/usr/bin/env bash
# The expert weight-gradient GEMM (moe/kernels/grouped_wgrad.py) with its accumulator tile asked of L2
# before the main loop against without (MOE_WGRAD_PREFETCH=0), on one H200 (MOE_GIT_COMMIT=$(git rev-parse HEAD)):
# bench.wgrad --prefetch (checked bitwise against no prefetch first), bench.model at OLMoE width
# (8 layers, micro 4 x accum 4) each way twice back to back, then the Qwen-like `moe train` run each way.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
step=(--layers 8 --micro 4 --accum 4 --warmup 2 --steps 8)
run python3 -m bench.wgrad --prefetch --case olmoe --case qwen-like --case qwen-like-collapsed
for i in 1 2; do
  run python3 -m bench.model "${step[@]}"
  run env MOE_WGRAD_PREFETCH=0 python3 -m bench.model "${step[@]}"
done
tokens_8k
run python3 -c "from bench.common import matmul_peak_tflops; print(f'bf16 matmul 8192^3 on this GPU: {matmul_peak_tflops():.0f} TFLOP/s')"
qwen_like_train qwen-like-wgrad-prefetch
MOE_WGRAD_PREFETCH=0 qwen_like_train qwen-like-wgrad-no-prefetch
exit $status
