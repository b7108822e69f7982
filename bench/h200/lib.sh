# Shared by the bench/h200 scripts (sourced from the repository root): the device environment
# (NVLink multicast off, this checkout on PYTHONPATH, $OUT), and `run`: one command with a time
# limit, logged to $OUT/run.log, the JSON results it wrote copied to $OUT. Sets status=1 on any failure.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/moe-out}
mkdir -p "$OUT"
LOG="$OUT/run.log"
status=0
touch /tmp/run-start
run() {
  echo "+ $*" | tee -a "$LOG"
  timeout "${RUN_TIMEOUT:-300}" "$@" 2>&1 | grep -v -i 'warning' | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  find bench/results -name '*.json' -newer /tmp/run-start -exec cp {} "$OUT"/ \;
}
# The device machine's copy of the checkout carries stale git metadata: name the commit that ran.
if [ -z "${MOE_GIT_COMMIT:-}" ]; then
  echo "warning: MOE_GIT_COMMIT is not set; the JSON records will name the device copy's stale git metadata" >&2
fi
# The corpus of the `moe train` scripts: an 8,192-entry BPE on the Python standard library, in /tmp/tok8k.
TOK=/tmp/tok8k
tokens_8k() {
  if [ ! -f "$TOK/manifest.json" ]; then
    run python3 -m pipeline.cli tokenize --no-mlflow --set tokenize.vocab_size=8192 --set tokenize.max_bytes=20000000 \
      --set tokenize.workers=14 --set tokenize.output="$TOK"
  fi
}
# The Qwen3-30B-A3B-like shape through `moe train` (128 experts of 768, top-8, d=2048, 8 layers, seq 4096,
# micro 4 x accum 4, on the 8,192-entry BPE): qwen_like_train NAME [STEPS] [more --set or flags...];
# its metrics.jsonl and job.json land in $OUT as NAME.jsonl and NAME.job.json.
qwen_like_train() {
  local name=$1 steps=${2:-12}
  shift; [ $# -gt 0 ] && shift
  rm -rf "/tmp/runs/$name"
  run python3 -m pipeline.cli train --no-mlflow --set tokenize.output="$TOK" --set model.vocab_size=8192 \
    --set recipe=olmoe-1b-7b --set model.n_layers=8 --set model.moe.num_experts=128 --set model.moe.expert_hidden=768 \
    --set model.moe.top_k=8 --set train.global_batch_size=16 --set train.micro_batch_size=4 --set train.max_steps="$steps" \
    --set train.device=cuda --set train.eval_every=0 --set train.log_every=1 \
    --set checkpoint.save=false --set executor.run_dir="/tmp/runs/$name" --set checkpoint.dir="/tmp/runs/$name/checkpoints" "$@"
  cp "/tmp/runs/$name/metrics.jsonl" "$OUT/$name.jsonl"
  cp "/tmp/runs/$name/job.json" "$OUT/$name.job.json"
}
