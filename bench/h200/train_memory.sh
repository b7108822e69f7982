#!/usr/bin/env bash
# `moe train`'s measured peak memory, bf16 against FP8 (fp8_rowwise, the shipped rule), at the shapes the
# planner test re-plans (tests/plan/test_train_records.py): the olmoe-1b-7b recipe at 4 layers, seq 4096,
# micro 8 x accum 2, and the paper-8l recipe at 2 layers, seq 8192, micro 2 x accum 8; learned routing,
# dropless, an 8,192-entry BPE trained on the Python standard library. One H200:
#   MOE_GIT_COMMIT=$(git rev-parse HEAD) bench/h200/train_memory.sh
# Each run's metrics.jsonl and job.json come back as <name>.jsonl / <name>.job.json.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
tokens_8k
train() {  # name, then --set overrides
  local name=$1; shift
  rm -rf "/tmp/runs/$name"
  run python3 -m pipeline.cli train --no-mlflow --set tokenize.output="$TOK" --set model.vocab_size=8192 \
    --set train.device=cuda --set train.eval_every=0 --set train.log_every=1 --set checkpoint.save=false \
    --set executor.run_dir="/tmp/runs/$name" --set checkpoint.dir="/tmp/runs/$name/checkpoints" "$@"
  cp "/tmp/runs/$name/metrics.jsonl" "$OUT/$name.jsonl"
  cp "/tmp/runs/$name/job.json" "$OUT/$name.job.json"
}
olmoe=(--set recipe=olmoe-1b-7b --set model.n_layers=4 --set train.global_batch_size=16 --set train.micro_batch_size=8 --set train.max_steps=6)
paper=(--set recipe=paper-8l --set model.n_layers=2 --set train.global_batch_size=16 --set train.micro_batch_size=2 --set train.max_steps=4)
for which in olmoe paper; do
  declare -n shape=$which
  for recipe in fp8_rowwise bf16; do
    train "$which-$recipe" "${shape[@]}" --set precision.recipe=$recipe
  done
done
exit $status
