#!/usr/bin/env bash
# Does the router's input gradient folded into the gather's (moe.layers.router, MOE_ROUTER_INPUT_GRAD=gemm,
# the default) pay? One profiled eager step with the fold and one without (kernel time per category and the
# largest kernels), then graphed paired steps alternated fold on / off / on / off. OLMoE width, micro 4 x accum 4,
# 6 layers on a GPU under 100 GiB (an H100), else 8. JSON and logs land in $OUT.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
export MOE_GRAD_ADD=triton MOE_SHARED_INPUT_GRAD=gemm MOE_RESIDUAL_ADD=combine
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mib" -ge 100000 ]; then layers=8; else layers=6; fi
echo "GPU memory ${mib} MiB: OLMoE width at ${layers} layers" | tee -a "$LOG"
step=(--layers "$layers" --micro 4 --accum 4 --warmup 2 --steps 8 --expert-wgrad paired)
prof=(--layers "$layers" --micro 4 --accum 4 --warmup 3 --steps 4 --expert-wgrad paired --profile 40 --no-save)
run python3 -m bench.model "${prof[@]}"
run env MOE_ROUTER_INPUT_GRAD=autograd python3 -m bench.model "${prof[@]}"
for i in 1 2; do
  run python3 -m bench.model "${step[@]}" --cuda-graph
  run env MOE_ROUTER_INPUT_GRAD=autograd python3 -m bench.model "${step[@]}" --cuda-graph
done
exit $status
