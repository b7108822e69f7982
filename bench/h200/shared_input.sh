#!/usr/bin/env bash
# The q/k/v input-gradient sum in the GEMMs (moe.nn.shared_input, MOE_SHARED_INPUT_GRAD=gemm) against autograd's
# adds, alternated, three pairs, OLMoE width, paired expert wgrad, graphed; then one profile of each (eager, the
# kernel list in $OUT/run.log). 8 layers on a GPU of 100 GiB or more, else 6. JSON and logs land in $OUT.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
export MOE_GRAD_ADD=triton MOE_RESIDUAL_ADD=combine
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mib" -ge 100000 ]; then layers=8; else layers=6; fi
echo "GPU memory ${mib} MiB: OLMoE width at ${layers} layers" | tee -a "$LOG"
step=(--layers "$layers" --micro 4 --accum 4 --warmup 2 --steps 8 --expert-wgrad paired --cuda-graph)
for pair in 1 2 3; do
  run env MOE_SHARED_INPUT_GRAD=gemm python3 -m bench.model "${step[@]}"
  run env MOE_SHARED_INPUT_GRAD=autograd python3 -m bench.model "${step[@]}"
done
for way in gemm autograd; do
  run env MOE_SHARED_INPUT_GRAD=$way python3 -m bench.model --layers "$layers" --micro 4 --accum 4 --warmup 3 --steps 4 \
    --expert-wgrad paired --profile 40 --no-save
done
exit $status
