#!/usr/bin/env bash
# Whether train.deterministic needs torch's fill of uninitialised memory (NaN in every new tensor), and what
# it costs: bench.model at OLMoE width, 8 layers, micro 4 x accum 4, the deterministic mode with the fill
# (MOE_DETERMINISTIC_FILL=1) and without (the default since 2026-12-04): the losses must be bitwise equal.
# Then train.layout_invariant (twice) and the default mode, for the ratios.
#   MOE_GIT_COMMIT=$(git rev-parse HEAD) bench/h200/determinism_fill.sh
set -uo pipefail
source "$(dirname "$0")/lib.sh"
export CUBLAS_WORKSPACE_CONFIG=:4096:8
step=(--layers 8 --micro 4 --accum 4 --warmup 2 --steps 8)
MOE_DETERMINISTIC_FILL=1 run python3 -m bench.model "${step[@]}" --deterministic
run python3 -m bench.model "${step[@]}" --deterministic
run python3 -m bench.model "${step[@]}" --layout-invariant
run python3 -m bench.model "${step[@]}" --layout-invariant
run python3 -m bench.model "${step[@]}"
MOE_DETERMINISTIC_FILL=1 run python3 -m bench.model "${step[@]}" --layout-invariant
python3 - "$OUT" <<'PY'
import glob, json, sys
rows = [json.load(open(f)) for f in sorted(glob.glob(f"{sys.argv[1]}/model-*.json"))]
for d in rows:
    r = d["result"]
    print(round(r["step_s"], 4), r["peak_mem_gib"], d["environment"].get("determinism", {}).get("torch.utils.deterministic.fill_uninitialized_memory"), d["losses"][-1])
print("deterministic, fill vs none, bitwise:", rows[0]["losses"] == rows[1]["losses"])
print("layout-invariant runs bitwise:", rows[2]["losses"] == rows[3]["losses"] == rows[5]["losses"])
PY
exit $status
