#!/usr/bin/env bash
# optim.expert_wgrad=paired on the warp-specialised wgrad kernel (moe/kernels/grouped_wgrad_ws.py, which
# now takes both micro-batches' rows in one GEMM) against paired on the Triton kernel (MOE_WGRAD_KERNEL=triton)
# and against the default (gemm, ws), at HEAD (MOE_GIT_COMMIT=$(git rev-parse HEAD)): the GPU check
# (paired cases bitwise against the Triton kernel; stops here if wrong or hung), bench.model at OLMoE
# width (micro 4 x accum 4) three ways, and the Qwen-like `moe train` run paired each way. On a GPU under
# 100 GiB (an H100) the step runs at 6 layers and the Qwen-like run at 4, else at 8 and 8.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mib" -ge 100000 ]; then layers=8 qwen_layers=8; else layers=6 qwen_layers=4; fi
echo "GPU memory ${mib} MiB: OLMoE width at ${layers} layers, Qwen-like at ${qwen_layers}" | tee -a "$LOG"
RUN_TIMEOUT=150 run python3 tests/kernels/grouped_wgrad_ws_gpu_check.py  # a hang (a barrier never flipped) stops here
[ "$status" -eq 0 ] || exit 1
step=(--layers "$layers" --micro 4 --accum 4 --warmup 2 --steps 8)
run python3 -m bench.model "${step[@]}" --expert-wgrad paired
run env MOE_WGRAD_KERNEL=triton python3 -m bench.model "${step[@]}" --expert-wgrad paired
run python3 -m bench.model "${step[@]}"
tokens_8k
qwen_like_train qwen-like-paired-ws 12 --set model.n_layers="$qwen_layers" --set optim.expert_wgrad=paired
export MOE_WGRAD_KERNEL=triton
qwen_like_train qwen-like-paired-triton 12 --set model.n_layers="$qwen_layers" --set optim.expert_wgrad=paired
unset MOE_WGRAD_KERNEL
exit $status
