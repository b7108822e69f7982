#!/usr/bin/env bash
# The optimizer step's kernel (optim.step_kernel: triton against torch's fused AdamW + copy), on one
# H200, one part per call (pass the commit: MOE_GIT_COMMIT=$(git rev-parse HEAD)).
#   bench/h200/optimizer_step.sh kernel  # bench.adamw at OLMoE width and the Qwen-like shape (8 layers), outputs
#                                        # checked first; then bench.model (OLMoE width, 8 layers, micro 4 x accum 4)
#                                        # triton, torch, triton, torch back to back
#   bench/h200/optimizer_step.sh qwen    # bench.adamw at the Qwen-like shape; that shape through `moe train` (as step_speed.sh qwen),
#                                        # step_kernel triton then torch, after the same call's matmul peak; then the
#                                        # layout-invariant check (DDP, ZeRO-1, FSDP bitwise) with the Triton step
#   bench/h200/optimizer_step.sh qwen-profile  # the wgrad kernel's tile sweep at the Qwen-like and OLMoE shapes, and
#                                        # the Qwen-like `moe train` run with step 6 profiled (profile/<category>_ms)
#   bench/h200/optimizer_step.sh breakdown  # the OLMoE-width step profiled with the Triton step; the Qwen-like run with
#                                        # optim.expert_grad_accum fp32 (default) and bf16 (what the fp32 accumulator costs)
#   bench/h200/optimizer_step.sh fp8     # the profiled OLMoE-width step (the Triton step attributed); the fp8_rowwise
#                                        # recipe (released expert weights: no bf16 copy) with each step kernel
set -uo pipefail
source "$(dirname "$0")/lib.sh"
step=(--layers 8 --micro 4 --accum 4 --warmup 2 --steps 8)
case "${1:-}" in
  kernel)
    run python3 -m bench.adamw --width olmoe
    run python3 -m bench.adamw --width qwen
    run python3 -m bench.model "${step[@]}"
    run python3 -m bench.model "${step[@]}" --torch-adamw
    run python3 -m bench.model "${step[@]}"
    run python3 -m bench.model "${step[@]}" --torch-adamw
    ;;
  qwen)
    run python3 -m bench.adamw --width qwen
    tokens_8k
    run python3 -c "from bench.common import matmul_peak_tflops; print(f'bf16 matmul 8192^3 on this GPU: {matmul_peak_tflops():.0f} TFLOP/s')"
    for kernel in triton torch; do
      qwen_like_train qwen-like-step-kernel-$kernel 12 --set optim.step_kernel=$kernel
    done
    mkdir -p bench/results/layout_invariant
    CUBLAS_WORKSPACE_CONFIG=:4096:8 RUN_TIMEOUT=400 run python3 tests/train/layout_invariant_gpu_check.py \
      "bench/results/layout_invariant/ranks-on-one-gpu-triton-step-$(date -u +%Y%m%dT%H%M%SZ).json"
    ;;
  qwen-profile)
    run python3 -m bench.adamw --width qwen
    RUN_TIMEOUT=240 run python3 -m bench.wgrad --configs all --case qwen-like --case olmoe
    tokens_8k
    qwen_like_train qwen-like-step-kernel-triton-profiled 8 --set train.profile_step=6
    ;;
  breakdown)
    run python3 -m bench.model "${step[@]}" --profile 30 --no-save
    tokens_8k
    run python3 -c "from bench.common import matmul_peak_tflops; print(f'bf16 matmul 8192^3 on this GPU: {matmul_peak_tflops():.0f} TFLOP/s')"
    for accum in fp32 bf16; do
      qwen_like_train qwen-like-expert-grad-accum-$accum 12 --set optim.expert_grad_accum=$accum
    done
    ;;
  fp8)
    run python3 -m bench.model "${step[@]}" --profile 30 --no-save
    run python3 -m bench.model "${step[@]}" --recipe fp8_rowwise
    run python3 -m bench.model "${step[@]}" --recipe fp8_rowwise --torch-adamw
    ;;
  *) echo "usage: $0 kernel|qwen|qwen-profile|breakdown|fp8" >&2; exit 2 ;;
esac
exit $status
