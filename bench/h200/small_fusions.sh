#!/usr/bin/env bash
# Small levers of the step, side by side on one GPU (MOE_GIT_COMMIT=$(git rev-parse HEAD)), each opt-in
# until measured: the forward row gather in Triton (MOE_GATHER_ROWS=triton; default index_select), the
# residual's gradient added in the norm's backward pass (MOE_RESIDUAL_NORM=1; default autograd's add), and
# the wgrad kernel's left half of each old sum loaded before its main loop (MOE_WGRAD_PRELOAD=1); the
# gradient norm in one multi-tensor launch is the default (against the earlier calls). bench.gather and
# bench.wgrad --preload first (outputs checked bitwise), then bench.model at OLMoE width (8 layers, micro
# 4 x accum 4) under each switch, the Qwen-like `moe train` run, and one profiled OLMoE-width step.
# On a GPU with less than 100 GiB (an H100) the same pairs run at 6 layers (OLMoE width) and 4 layers
# (Qwen-like), which fit its 80 GiB: the levers' ratios, not issue 49's figures.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$gib" -ge 100000 ]; then layers=8 qwen_layers=8; else layers=6 qwen_layers=4; fi
echo "GPU memory ${gib} MiB: OLMoE width at ${layers} layers, Qwen-like at ${qwen_layers}" | tee -a "$LOG"
step=(--layers "$layers" --micro 4 --accum 4 --warmup 2 --steps 8)
on=(MOE_GATHER_ROWS=triton MOE_RESIDUAL_NORM=1)
run python3 -m bench.gather
run python3 -m bench.wgrad --preload --case olmoe --case qwen-like --case qwen-like-collapsed
for i in 1 2; do
  run python3 -m bench.model "${step[@]}"
  run env "${on[@]}" python3 -m bench.model "${step[@]}"
  run env MOE_GATHER_ROWS=triton python3 -m bench.model "${step[@]}"
  run env MOE_RESIDUAL_NORM=1 python3 -m bench.model "${step[@]}"
  run env MOE_WGRAD_PRELOAD=1 python3 -m bench.model "${step[@]}"
done
tokens_8k
run python3 -c "from bench.common import matmul_peak_tflops; print(f'bf16 matmul 8192^3 on this GPU: {matmul_peak_tflops():.0f} TFLOP/s')"
qwen_like_train qwen-like-small-fusions-off 12 --set model.n_layers="$qwen_layers"
export "${on[@]}" && qwen_like_train qwen-like-small-fusions-on 12 --set model.n_layers="$qwen_layers" && unset MOE_GATHER_ROWS MOE_RESIDUAL_NORM
MOE_WGRAD_PRELOAD=1 qwen_like_train qwen-like-wgrad-preload 12 --set model.n_layers="$qwen_layers"
run env "${on[@]}" python3 -m bench.model "${step[@]}" --profile 30 --no-save
exit $status
