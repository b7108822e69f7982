#!/usr/bin/env bash
# Expert count on one H200 (issue 29): experts 8 -> 128 at constant active parameters (OLMoE width, 4 layers,
# 16K tokens per micro-batch, 16 micro-batches = 262K tokens per optimizer step), dropless,
# with the expert gradients accumulated in fp32 (today) and in bf16 (optim.expert_grad_accum).
#   bench/h200/expert_count.sh            # random routing fp32/bf16, learned routing bf16
#   bench/h200/expert_count.sh profile    # one profiled step at E=8 and E=128 (bf16 accumulation)
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/moe-out}
mkdir -p "$OUT"
touch /tmp/expert-count-start
run() {  # routing experts accumulation
  python3 -m bench.model --layers 4 --seq 4096 --micro 4 --accum 16 --warmup 2 --steps 5 \
    --routing "$1" --experts "$2" --expert-grad-accum "$3" 2>&1 | tail -4
}
if [ "${1:-sweep}" = profile ]; then
  for e in 8 128; do
    python3 -m bench.model --layers 4 --seq 4096 --micro 4 --accum 16 --warmup 1 --steps 2 --routing random \
      --experts "$e" --expert-grad-accum bf16 --profile 30 --no-save > "$OUT/profile_e$e.txt" 2>&1
    grep "profiled step" "$OUT/profile_e$e.txt"
  done
  exit 0
fi
for accum in fp32 bf16; do
  for e in 8 128; do run random "$e" "$accum"; done
done
for e in 8 128; do run learned "$e" bf16; done
find bench/results -name 'model-*.json' -newer /tmp/expert-count-start -exec cp {} "$OUT"/ \;
