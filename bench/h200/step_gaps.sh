#!/usr/bin/env bash
# Where the step's time goes after the wgrad epilogue change, with the GPU's idle gaps
# (bench.model --profile prints them), on one H200 (MOE_GIT_COMMIT=$(git rev-parse HEAD)): the
# wgrad epilogue variants (bench.wgrad --epilogue), the profiled OLMoE-width step, the profiled
# Qwen-like-expert step in bench.model (128 experts of 768), and the Qwen-like `moe train` run's
# profiled step (train.profile_step).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
step=(--layers 8 --micro 4 --accum 4 --warmup 2 --steps 8)
run python3 -m bench.wgrad --epilogue --case olmoe --case qwen-like --case qwen-like-collapsed
run python3 -m bench.model "${step[@]}" --profile 40 --no-save
run python3 -m bench.model "${step[@]}" --width qwen-like --experts 128 --profile 40 --no-save
tokens_8k
qwen_like_train qwen-like-profiled 8 --set train.profile_step=6
exit $status
