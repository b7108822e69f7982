#!/usr/bin/env bash
# The training step against the same call's measured bf16 matmul peak (issue 49 item 2), on one H200,
# one part per call (pass the commit: MOE_GIT_COMMIT=$(git rev-parse HEAD)).
#   bench/h200/step_speed.sh wgrad    # the weight-gradient kernel's tile sweep (bench.wgrad --configs all)
#   bench/h200/step_speed.sh levers   # OLMoE width, 8 layers, micro 4 x accum 4: fused loss against torch's, profiled
#   bench/h200/step_speed.sh qwen     # Qwen3-30B-A3B-like experts (128 of 768, top-8, d=2048, 8 layers, seq 4096,
#                                     # micro 4 x accum 4) through `moe train` on an 8,192-entry BPE, after bench.model's
#                                     # matmul peak in the same call
#   bench/h200/step_speed.sh qwen-profile  # the same run, fused loss, with step 6 profiled (profile/<category>_ms)
set -uo pipefail
source "$(dirname "$0")/lib.sh"
step=(--layers 8 --micro 4 --accum 4 --warmup 2 --steps 8)
case "${1:-}" in
  wgrad) RUN_TIMEOUT=240 run python3 -m bench.wgrad --configs all ;;
  levers)
    run python3 -m bench.model "${step[@]}"
    run python3 -m bench.model "${step[@]}" --torch-loss
    run python3 -m bench.model "${step[@]}" --profile 30 --no-save
    ;;
  qwen|qwen-profile)
    tokens_8k
    run python3 -c "from bench.common import matmul_peak_tflops; print(f'bf16 matmul 8192^3 on this GPU: {matmul_peak_tflops():.0f} TFLOP/s')"
    losses=(true false); extra=()
    [ "${1}" = qwen-profile ] && { losses=(true); extra=(--set train.profile_step=6); }
    for loss in "${losses[@]}"; do
      [ "${1}" = qwen-profile ] && name=qwen-like-fused-loss-$loss-profiled || name=qwen-like-fused-loss-$loss
      qwen_like_train "$name" 12 --set train.fused_loss=$loss "${extra[@]}"
    done
    ;;
  *) echo "usage: $0 wgrad|levers|qwen|qwen-profile" >&2; exit 2 ;;
esac
exit $status
