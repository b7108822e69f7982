#!/usr/bin/env bash
# The warp-specialised wgrad kernel that fetches the old sum under the main loop (moe/kernels/grouped_wgrad_ws.py,
# the default on sm90) against the Triton kernel (MOE_WGRAD_KERNEL=triton), at HEAD (MOE_GIT_COMMIT=$(git rev-parse HEAD)):
# its GPU check (float64 reference, the Triton kernel bitwise, reruns; stops here if wrong or hung), layout
# invariance on CUDA with it (dp 4/2/1 ranks sharing the GPU over gloo, DDP/ZeRO-1/FSDP, resumes),
# bench.wgrad --ws (outputs checked bitwise first), bench.model at OLMoE width (micro 4 x accum 4) each way
# twice back to back (each also timed back to back without a synchronisation per step), and the Qwen-like
# `moe train` run each way, the ws one also logged every 4 steps (fit then synchronises once per 4 steps). On a GPU
# under 100 GiB (an H100) the step
# runs at 6 layers and the Qwen-like run at 4, else at 8 and 8.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
mkdir -p bench/results/layout_invariant
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mib" -ge 100000 ]; then layers=8 qwen_layers=8; else layers=6 qwen_layers=4; fi
echo "GPU memory ${mib} MiB: OLMoE width at ${layers} layers, Qwen-like at ${qwen_layers}" | tee -a "$LOG"
RUN_TIMEOUT=150 run python3 tests/kernels/grouped_wgrad_ws_gpu_check.py  # a hang (a barrier never flipped) stops here
[ "$status" -eq 0 ] || exit 1
CUBLAS_WORKSPACE_CONFIG=:4096:8 RUN_TIMEOUT=300 run python3 tests/train/layout_invariant_gpu_check.py \
  "bench/results/layout_invariant/ranks-on-one-gpu-wgrad-ws-$(date -u +%Y%m%dT%H%M%SZ).json"
run python3 -m bench.wgrad --ws --case olmoe --case qwen-like --case qwen-like-collapsed
run python3 -m bench.wgrad --case olmoe  # the default mode: the shipped ws kernel beside the Triton tile configs
step=(--layers "$layers" --micro 4 --accum 4 --warmup 2 --steps 8)
for i in 1 2; do
  run python3 -m bench.model "${step[@]}"
  run env MOE_WGRAD_KERNEL=triton python3 -m bench.model "${step[@]}"
done
tokens_8k
run python3 -c "from bench.common import matmul_peak_tflops; print(f'bf16 matmul 8192^3 on this GPU: {matmul_peak_tflops():.0f} TFLOP/s')"
qwen_like_train qwen-like-wgrad-ws 12 --set model.n_layers="$qwen_layers"
# the same run logged every 4 steps: fit synchronises only at a log, so steps 5-16 run back to back
qwen_like_train qwen-like-wgrad-ws-log4 16 --set model.n_layers="$qwen_layers" --set train.log_every=4
export MOE_WGRAD_KERNEL=triton
qwen_like_train qwen-like-wgrad-triton 12 --set model.n_layers="$qwen_layers"
unset MOE_WGRAD_KERNEL
exit $status
