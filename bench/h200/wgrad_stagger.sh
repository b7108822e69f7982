#!/usr/bin/env bash
# The wgrad kernel's persistent programs started in phases (MOE_WGRAD_STAGGER), so their fp32 epilogues
# do not all hit memory at once (MOE_GIT_COMMIT=$(git rev-parse HEAD)): the kernel alone under every
# variant (bitwise against all-at-once first), then the best variant in the step at OLMoE width against
# all-at-once, twice, and the Qwen-like `moe train` run both ways. On a GPU under 100 GiB (an H100) the
# step runs at 6 layers and the Qwen-like run at 4 (80 GiB), else at 8 and 8.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
mkdir -p bench/results
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mib" -ge 100000 ]; then layers=8 qwen_layers=8; else layers=6 qwen_layers=4; fi
echo "GPU memory ${mib} MiB: OLMoE width at ${layers} layers, Qwen-like at ${qwen_layers}" | tee -a "$LOG"
run python3 -m bench.wgrad --stagger --case olmoe --case qwen-like --case qwen-like-collapsed
# the variant with the least time summed over the random-routing cases (both weights)
best=$(python3 - <<'PY'
import glob, json, re
rows = json.load(open(sorted(glob.glob("bench/results/wgrad-*.json"))[-1]))["rows"]
total = {}
for r in rows:
    if "collapsed" not in r["case"] and r["median_ms"] == r["median_ms"] and "phases" in r["variant"]:
        total[r["variant"]] = total.get(r["variant"], 0.0) + r["median_ms"]
p, f = re.match(r"(\d+) phases over ([\d.]+) tile", min(total, key=total.get)).groups()
print(f"{p}:{f}")
PY
)
echo "best stagger: $best" | tee -a "$LOG"
step=(--layers "$layers" --micro 4 --accum 4 --warmup 2 --steps 8)
for i in 1 2; do
  run env MOE_WGRAD_STAGGER="$best" python3 -m bench.model "${step[@]}"
  run python3 -m bench.model "${step[@]}"
done
tokens_8k
run python3 -c "from bench.common import matmul_peak_tflops; print(f'bf16 matmul 8192^3 on this GPU: {matmul_peak_tflops():.0f} TFLOP/s')"
export MOE_WGRAD_STAGGER="$best"
qwen_like_train qwen-like-stagger 12 --set model.n_layers="$qwen_layers"
unset MOE_WGRAD_STAGGER
qwen_like_train qwen-like-no-stagger 12 --set model.n_layers="$qwen_layers"
exit $status
