#!/usr/bin/env bash
# How long a checkpoint holds training, asynchronous (checkpoint.asynchronous=true, the default) against
# synchronous, through `moe train` on one H200: the olmoe-1b-7b recipe at 4 layers (its 50,304-entry vocabulary;
# data from an 8,192-entry BPE on the Python standard library), seq 4096, micro 4 x accum 4 (65,536 tokens per
# optimizer step), learned routing, dropless, a save at step 30 (about 22 GB with the optimizer state) and at the
# end. Compare the interval after the save (steps 31-40) with the one before (21-30): tokens_per_s, and
# checkpoint/blocked_s. Then the disk's own speed (dd with fsync) and sha256's, for the write's floor.
#   MOE_GIT_COMMIT=$(git rev-parse HEAD) bench/h200/checkpoint_stall.sh
#   MODES=true FLOORS=0 ...   # the asynchronous run alone (host buffers allocated ahead since e.g. the first save)
set -uo pipefail
source "$(dirname "$0")/lib.sh"
tokens_8k
for mode in ${MODES:-true false}; do
  name=ckpt-async-$mode
  rm -rf /tmp/runs
  RUN_TIMEOUT=280 run python3 -m pipeline.cli train --no-mlflow --set tokenize.output="$TOK" \
    --set recipe=olmoe-1b-7b --set model.n_layers=4 --set train.global_batch_size=16 --set train.micro_batch_size=4 \
    --set train.max_steps=40 --set train.log_every=10 --set train.eval_every=0 --set train.device=cuda \
    --set checkpoint.every=30 --set checkpoint.keep_last=1 --set checkpoint.asynchronous=$mode \
    --set executor.run_dir=/tmp/runs/$name --set checkpoint.dir=/tmp/runs/$name/checkpoints
  cp /tmp/runs/$name/metrics.jsonl "$OUT/$name.jsonl"
  du -sh /tmp/runs/$name/checkpoints/* | tee -a "$LOG"
done
if [ "${FLOORS:-1}" = 1 ]; then  # the write's floor: disk and sha256 speed (FLOORS=0 skips it)
f=$(ls -S /tmp/runs/ckpt-async-*/checkpoints/step_*/*.distcp | head -1)
ls -l "$f" | tee -a "$LOG"
{ echo "sha256 of the largest shard:"; /usr/bin/time -f "%e s" sha256sum "$f"; } 2>&1 | tee -a "$LOG"
{ echo "dd 8 GiB with fsync:"; dd if=/dev/zero of=/tmp/dd.bin bs=64M count=128 conv=fsync 2>&1 | tail -1; rm -f /tmp/dd.bin; } | tee -a "$LOG"
df -h /tmp | tee -a "$LOG"
fi
rm -rf /tmp/runs
exit $status
