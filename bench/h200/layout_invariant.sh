#!/usr/bin/env bash
# What train.layout_invariant costs on one H200 (issue 53): bench.model at OLMoE width, 8 layers, micro 4 x
# accum 4, the default mode against train.deterministic and train.layout_invariant (each run its own process;
# step time and peak memory in the JSON), and the layout-invariant run twice (its losses must be equal).
#   MOE_GIT_COMMIT=$(git rev-parse HEAD) bench/h200/layout_invariant.sh
set -uo pipefail
source "$(dirname "$0")/lib.sh"
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # what the deterministic mode needs before cuBLAS starts
step=(--layers 8 --micro 4 --accum 4 --warmup 2 --steps 8)
run python3 -m bench.model "${step[@]}"
run python3 -m bench.model "${step[@]}" --deterministic
run python3 -m bench.model "${step[@]}" --layout-invariant
run python3 -m bench.model "${step[@]}" --layout-invariant
run python3 -m bench.model "${step[@]}" --deterministic
exit $status
