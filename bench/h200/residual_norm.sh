#!/usr/bin/env bash
# The residual's gradient added in the norm's backward pass, now the default, at HEAD on one GPU
# (MOE_GIT_COMMIT=$(git rev-parse HEAD)): layout invariance still bitwise on CUDA (dp 4/2/1 ranks sharing
# the GPU over gloo, DDP/ZeRO-1/FSDP, resumes), then bench.model at OLMoE width (micro 4 x accum 4) against
# MOE_RESIDUAL_NORM=0 (autograd's separate add), twice, and the Qwen-like `moe train` run. On a GPU under
# 100 GiB (an H100) the step runs at 6 layers and the Qwen-like run at 4 (80 GiB), else at 8 and 8.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mib" -ge 100000 ]; then layers=8 qwen_layers=8; else layers=6 qwen_layers=4; fi
echo "GPU memory ${mib} MiB: OLMoE width at ${layers} layers, Qwen-like at ${qwen_layers}" | tee -a "$LOG"
mkdir -p bench/results/layout_invariant
CUBLAS_WORKSPACE_CONFIG=:4096:8 RUN_TIMEOUT=300 run python3 tests/train/layout_invariant_gpu_check.py \
  "bench/results/layout_invariant/ranks-on-one-gpu-residual-norm-$(date -u +%Y%m%dT%H%M%SZ).json"
step=(--layers "$layers" --micro 4 --accum 4 --warmup 2 --steps 8)
for i in 1 2; do
  run python3 -m bench.model "${step[@]}"
  run env MOE_RESIDUAL_NORM=0 python3 -m bench.model "${step[@]}"
done
tokens_8k
run python3 -c "from bench.common import matmul_peak_tflops; print(f'bf16 matmul 8192^3 on this GPU: {matmul_peak_tflops():.0f} TFLOP/s')"
qwen_like_train qwen-like-residual-norm 12 --set model.n_layers="$qwen_layers"
exit $status
