#!/usr/bin/env bash
# The planner against measured peaks and FP8 memory (issues 36, 39), on one H200, one part per call. (Its `fused` part, the
# layer table of issue 38's fused expert MLP at its best tile, went with the fused path, whose
# code last existed at commit dfdbf43: bench/NOTES.md.)
#   bench/h200/plan_and_fp8_memory.sh plan      # moe plan against measured peaks at several accumulation counts and recompute modes
#   bench/h200/plan_and_fp8_memory.sh fp8mem    # where FP8's extra memory is: paper width at micro-batch 1 (bf16 and FP8), OLMoE width FP8
#   bench/h200/plan_and_fp8_memory.sh memory    # what is live at the peak: planner config (olmoe-1b-7b, 4 layers, 8x4096, 2 micro-batches) and paper width bf16 vs FP8
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-/tmp/moe-out}
mkdir -p "$OUT"
source "$(dirname "$0")/lib.sh"
case "${1:-}" in
  memory)
    run python3 -m bench.model --layers 4 --micro 8 --accum 2 --warmup 2 --steps 2 --peak-breakdown
    run python3 -m bench.model --width paper --layers 2 --micro 2 --accum 4 --warmup 2 --steps 2 --peak-breakdown
    run python3 -m bench.model --width paper --layers 2 --micro 2 --accum 4 --warmup 2 --steps 2 --peak-breakdown --recipe fp8_rowwise --fp8-min-dim 0
    ;;
  plan)  # the planner against measured peaks (plan_peak_gib beside peak_mem_gib), the olmoe-1b-7b recipe's z-loss on
    z="--logit-z-loss 1e-5 --warmup 2 --steps 2"
    run python3 -m bench.model --layers 4 --micro 8 --accum 2 $z
    run python3 -m bench.model --layers 4 --micro 8 --accum 2 $z --recompute selective
    run python3 -m bench.model --layers 4 --micro 8 --accum 1 $z
    run python3 -m bench.model --layers 8 --micro 4 --accum 4 $z --recompute selective
    run python3 -m bench.model --layers 6 --micro 4 --accum 2 $z --recompute full
    run python3 -m bench.model --layers 4 --micro 8 --accum 2 --warmup 2 --steps 2
    ;;
  fp8mem)  # issue 39: where FP8's extra memory is (paper width at micro-batch 1, where both fit; OLMoE width)
    run python3 -m bench.model --width paper --layers 2 --micro 1 --accum 4 --warmup 2 --steps 2 --peak-breakdown
    run python3 -m bench.model --width paper --layers 2 --micro 1 --accum 4 --warmup 2 --steps 2 --peak-breakdown --recipe fp8_rowwise --fp8-min-dim 0
    run python3 -m bench.model --layers 8 --micro 4 --accum 4 --warmup 2 --steps 2 --peak-breakdown --recipe fp8_rowwise --fp8-min-dim 0
    ;;
  *) echo "usage: $0 memory|plan|fp8mem" >&2; exit 2 ;;
esac
exit $status
