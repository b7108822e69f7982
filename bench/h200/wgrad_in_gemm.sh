#!/usr/bin/env bash
# The expert weight gradient accumulated inside its GEMM (issue 38), on one H200, one part per call
# (pass the commit: MOE_GIT_COMMIT=$(git rev-parse HEAD)).
#   bench/h200/wgrad_in_gemm.sh wgrad    # the weight-gradient GEMM alone: grouped_mm + add_ against the fused kernel, every tile config
#   bench/h200/wgrad_in_gemm.sh step     # OLMoE width, 8 layers, 4 micro-batches: optim.expert_wgrad gemm vs separate;
#                                  # paper width FP8 + FP8 dense with the library's allocator default
#   bench/h200/wgrad_in_gemm.sh experts  # the paper pipeline's experts stage (8 -> 128 experts), as bench/h200/paper.sh runs it
set -uo pipefail
source "$(dirname "$0")/lib.sh"
case "${1:-}" in
  wgrad) run python3 -m bench.wgrad --configs all ;;
  step)
    common=(--layers 8 --micro 4 --accum 4 --warmup 2 --steps 3)
    run python3 -m bench.model "${common[@]}" --expert-wgrad gemm
    run python3 -m bench.model "${common[@]}" --expert-wgrad separate
    run python3 -m bench.model --width paper --layers 2 --micro 4 --accum 4 --warmup 2 --steps 3 --recipe fp8_rowwise --fp8-dense
    ;;
  experts)
    start=$(date +%s)
    STEPS=2 RUN_TIMEOUT=330 run bash bench/h200/paper.sh experts
    echo "paper experts stage: $(( $(date +%s) - start )) s" | tee -a "$LOG"
    cp bench/paper/h200x1/results/experts.json "$OUT/" 2>/dev/null
    ;;
  *) echo "usage: $0 wgrad|step|experts" >&2; exit 2 ;;
esac
exit $status
