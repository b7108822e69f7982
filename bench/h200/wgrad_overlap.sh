#!/usr/bin/env bash
# The Gluon wgrad kernel that reads each tile's old sum under its main loop (MOE_WGRAD_KERNEL=overlap,
# moe/kernels/grouped_wgrad_overlap.py) against the Triton kernel, on one H200 (MOE_GIT_COMMIT=$(git rev-parse HEAD)):
# its GPU check (float64 reference, the Triton kernel, reruns), bench.wgrad --overlap (outputs checked
# first), bench.model at OLMoE width (8 layers, micro 4 x accum 4) each way twice back to back, then the
# Qwen-like `moe train` run each way. Stops after the check if the kernel is wrong.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
step=(--layers 8 --micro 4 --accum 4 --warmup 2 --steps 8)
RUN_TIMEOUT=150 run python3 tests/kernels/grouped_wgrad_overlap_gpu_check.py  # a hang (a barrier never flipped) stops here
[ "$status" -eq 0 ] || exit 1
run python3 -m bench.wgrad --overlap --case olmoe --case qwen-like --case qwen-like-collapsed
for i in 1 2; do
  run python3 -m bench.model "${step[@]}"
  run env MOE_WGRAD_KERNEL=overlap python3 -m bench.model "${step[@]}"
done
tokens_8k
run python3 -c "from bench.common import matmul_peak_tflops; print(f'bf16 matmul 8192^3 on this GPU: {matmul_peak_tflops():.0f} TFLOP/s')"
qwen_like_train qwen-like-wgrad-triton
MOE_WGRAD_KERNEL=overlap qwen_like_train qwen-like-wgrad-overlap
exit $status
