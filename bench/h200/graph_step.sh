#!/usr/bin/env bash
# Issue 49 item 2: how much of the step is Python's launching. bench.graph_step times the same trainer's step
# eagerly and as one replayed CUDA graph (after a two-layer eager-vs-graphed loss check), at OLMoE width (8 layers,
# micro 4 x accum 4) with the default expert wgrad and with paired, and at the Qwen-like experts; then the Qwen-like
# `moe train` run with the default wgrad and paired. JSON and logs land in $OUT. On a GPU under 100 GiB (an H100)
# the step runs at 6 layers and the Qwen-like run at 4.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mib" -ge 100000 ]; then layers=8 qwen_layers=8; else layers=6 qwen_layers=4; fi
echo "GPU memory ${mib} MiB: OLMoE width at ${layers} layers, Qwen-like at ${qwen_layers}" | tee -a "$LOG"
step=(--layers "$layers" --micro 4 --accum 4 --warmup 2 --steps 8)
RUN_TIMEOUT=200 run python3 -m bench.graph_step "${step[@]}"
if [ "$status" -ne 0 ]; then  # the capture under non-expandable segments, in case those are what failed
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False
  status=0
  RUN_TIMEOUT=200 run python3 -m bench.graph_step "${step[@]}"
fi
tokens_8k
qwen_like_train qwen-like-ws 12 --set model.n_layers="$qwen_layers"
RUN_TIMEOUT=200 run python3 -m bench.graph_step "${step[@]}" --expert-wgrad paired
RUN_TIMEOUT=200 run python3 -m bench.graph_step --layers "$qwen_layers" --micro 4 --accum 4 --warmup 2 --steps 8 --width qwen-like --experts 128
qwen_like_train qwen-like-paired 12 --set model.n_layers="$qwen_layers" --set optim.expert_wgrad=paired
exit $status
