#!/usr/bin/env bash
# Issue 49 item 2 on the H200 at HEAD (MOE_GIT_COMMIT=$(git rev-parse HEAD)): the ws wgrad kernel's GPU check,
# then bench.model at OLMoE width (8 layers, micro 4 x accum 4) with the default wgrad (the ws kernel), with
# optim.expert_wgrad=paired, and once with the Triton kernel; each also timed back to back (step_s_pipelined).
# Then the Qwen-like `moe train` run the same three ways. JSON and logs land in $OUT. On a GPU under 100 GiB
# (an H100) the step runs at 6 layers and the Qwen-like run at 4, else at 8 and 8.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mib" -ge 100000 ]; then layers=8 qwen_layers=8; else layers=6 qwen_layers=4; fi
echo "GPU memory ${mib} MiB: OLMoE width at ${layers} layers, Qwen-like at ${qwen_layers}" | tee -a "$LOG"
RUN_TIMEOUT=150 run python3 tests/kernels/grouped_wgrad_ws_gpu_check.py  # a hang (a barrier never flipped) stops here
[ "$status" -eq 0 ] || exit 1
step=(--layers "$layers" --micro 4 --accum 4 --warmup 2 --steps 8)
for i in 1 2; do
  run python3 -m bench.model "${step[@]}"
  run python3 -m bench.model "${step[@]}" --expert-wgrad paired
done
run env MOE_WGRAD_KERNEL=triton python3 -m bench.model "${step[@]}"
tokens_8k
run python3 -c "from bench.common import matmul_peak_tflops; print(f'bf16 matmul 8192^3 on this GPU: {matmul_peak_tflops():.0f} TFLOP/s')"
qwen_like_train qwen-like-ws 12 --set model.n_layers="$qwen_layers"
qwen_like_train qwen-like-paired 12 --set model.n_layers="$qwen_layers" --set optim.expert_wgrad=paired
MOE_WGRAD_KERNEL=triton qwen_like_train qwen-like-triton 12 --set model.n_layers="$qwen_layers"
exit $status
