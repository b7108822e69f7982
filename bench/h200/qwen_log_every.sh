#!/usr/bin/env bash
# The Qwen-like `moe train` run (lib.sh qwen_like_train) at train.log_every=4 (each logged interval
# of 4 steps ends in one host sync, as the default of 10 does) against log_every=1 (a sync after
# every step), with optim.expert_wgrad gemm and paired, on one H200 (MOE_GIT_COMMIT=$(git rev-parse HEAD)).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
tokens_8k
run python3 -c "from bench.common import matmul_peak_tflops; print(f'bf16 matmul 8192^3 on this GPU: {matmul_peak_tflops():.0f} TFLOP/s')"
qwen_like_train qwen-like-log4-gemm 16 --set train.log_every=4
qwen_like_train qwen-like-log4-paired 16 --set train.log_every=4 --set optim.expert_wgrad=paired
qwen_like_train qwen-like-log1-gemm 16
run python3 -c "from bench.common import matmul_peak_tflops; print(f'bf16 matmul 8192^3 on this GPU: {matmul_peak_tflops():.0f} TFLOP/s')"
exit $status
