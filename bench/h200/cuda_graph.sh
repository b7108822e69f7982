#!/usr/bin/env bash
# Issue 49 item 2: train.cuda_graph, the whole step captured once and replayed. First its GPU tests (the
# deterministic mode's bits against the eager run, an exact resume, no host sync in replays), then bench.model at
# OLMoE width (micro 4 x accum 4) eager and graphed, with the default expert wgrad and with paired, and the
# Qwen-like `moe train` run graphed and eager. JSON and logs land in $OUT. On a GPU under 100 GiB (an H100) the
# step runs at 6 layers and the Qwen-like run at 4, else at 8 and 8.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mib" -ge 100000 ]; then layers=8 qwen_layers=8; else layers=6 qwen_layers=4; fi
echo "GPU memory ${mib} MiB: OLMoE width at ${layers} layers, Qwen-like at ${qwen_layers}" | tee -a "$LOG"
RUN_TIMEOUT=240 run python3 -m pytest -q -x -p no:cacheprovider tests/train/test_cuda_graph.py
step=(--layers "$layers" --micro 4 --accum 4 --warmup 2 --steps 8)
run python3 -m bench.model "${step[@]}"
run python3 -m bench.model "${step[@]}" --cuda-graph
run python3 -m bench.model "${step[@]}" --expert-wgrad paired --cuda-graph
run python3 -m bench.model "${step[@]}" --expert-wgrad paired
tokens_8k
qwen_like_train qwen-like-graph 12 --set model.n_layers="$qwen_layers" --set train.cuda_graph=true
qwen_like_train qwen-like-eager 12 --set model.n_layers="$qwen_layers"
exit $status
