#!/usr/bin/env bash
# optim.expert_wgrad=paired (one expert weight-gradient GEMM, one accumulator pass, per two
# micro-batches) against gemm, on one H200 (MOE_GIT_COMMIT=$(git rev-parse HEAD)): bench.model at
# OLMoE width (8 layers, micro 4 x accum 4) each way twice back to back (JSON to
# bench/results/wgrad_paired/, with the plan's peak beside the measured one), then the Qwen-like
# `moe train` run each way.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
step=(--layers 8 --micro 4 --accum 4 --warmup 2 --steps 8)
for i in 1 2; do
  run python3 -m bench.model "${step[@]}" --expert-wgrad paired
  run python3 -m bench.model "${step[@]}" --expert-wgrad gemm
done
tokens_8k
run python3 -c "from bench.common import matmul_peak_tflops; print(f'bf16 matmul 8192^3 on this GPU: {matmul_peak_tflops():.0f} TFLOP/s')"
qwen_like_train qwen-like-wgrad-paired 12 --set optim.expert_wgrad=paired
qwen_like_train qwen-like-wgrad-gemm 12 --set optim.expert_wgrad=gemm
exit $status
