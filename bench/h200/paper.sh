#!/usr/bin/env bash
# The paper pipeline's stages on one H200 in the paper's regime (issue 29): 262,144 tokens per
# optimizer step by accumulation, random routing (+ learned rows for the experts sweep),
# dropless, bf16 expert-gradient accumulation, one profiled step per variant. Without DVC or
# MLflow (neither is in the device image); the report is written from the results afterwards
# (`python -m pipeline.cli paper report --no-mlflow --set paper.results=h200x1/results` in bench/paper).
#   MOE_GIT_COMMIT=<commit> bench/h200/paper.sh experts fp8      # stages to run (default: all)
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/moe-out}
mkdir -p "$OUT"
root=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
cd "$root/bench/paper"
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(resident experts fp8 recompute ep gerrymander)
common=(--no-mlflow --set "paper.steps=${STEPS:-2}" --set 'paper.experts=[8,32,128]' --set paper.gerrymander_steps=60
  --set executor.nprocs=1 --set paper.results=h200x1/results --set paper.work_dir=/tmp/paper-runs)
for s in "${stages[@]}"; do
  if [ "$s" = gerrymander ]; then
    python3 -m pipeline.cli paper tokenize "${common[@]:1}" 2>&1 | tail -2
  fi
  start=$(date +%s)
  python3 -m pipeline.cli paper stage "$s" "${common[@]}" > "$OUT/stage-$s.log" 2>&1 || { tail -30 "$OUT/stage-$s.log"; exit 1; }
  echo "stage $s: $(( $(date +%s) - start )) s"
  cp "h200x1/results/$s.json" "$OUT/"
done
