#!/usr/bin/env bash
# Kernels on one H200 (issue 30): our layer against its GEMMs alone and SonicMoE, and the FP8 token-row
# path. Not run yet (the session that built them had no device time left). The fused expert MLP
# (issue 31) this script also timed was measured slower than torch's grouped GEMM and removed
# (issue 38, bench/NOTES.md). Each part fits one device call (< 10 min):
#   bench/h200/kernels.sh check     # first: the FP8 token-row path with the compiled Triton kernels
#   bench/h200/kernels.sh layer     # the five-shape table: ours, gemm, sonic
#   bench/h200/kernels.sh experts   # experts 8 -> 256 at d=2048 h=1024 k=8
#   bench/h200/kernels.sh step      # full step at OLMoE width (8 layers, micro 4): bf16, then fp8_rowwise
#                                   # with every expert GEMM in FP8 (token-row path), then the dense
#                                   # projections too (precision.fp8_dense)
#   bench/h200/kernels.sh paper     # paper width, 2 layers: bf16, FP8 experts, FP8 experts + dense
# bench.layer checks every peer's output and input gradient against an fp32 run before timing.
# Every run's output goes to $OUT/kernels.log as it happens and its JSON to $OUT after each run,
# so a failing or killed run loses only itself.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-/tmp/moe-out}
mkdir -p "$OUT"
LOG="$OUT/kernels.log"
touch /tmp/kernels-start
status=0
run() {
  echo "+ $*" | tee -a "$LOG"
  "$@" 2>&1 | tee -a "$LOG" || status=1
  find bench/results -name '*.json' -newer /tmp/kernels-start -exec cp {} "$OUT"/ \;
}
case "${1:-}" in
  check)  # the FP8 token-row path with the compiled quantisation, gather and combine kernels (GEMMs
    # emulated) against the gathered path: CI checks the kernels under the interpreter
    # (tests/kernels/fp8_check.py) and this path on torch's (tests/layers/test_gemm_fp8.py)
    run python3 -c 'import torch; torch.set_default_device("cuda")
from tests.layers.test_gemm_fp8 import test_fp8_experts_on_token_rows_match_the_gathered_path as check
check(0); check(10**6); print("fp8 token-row path ok")'
    ;;
  layer)
    run python3 -m bench.layer --tokens 16384 --peers ours,gemm,sonic \
      --shape 2048,1024,64,8 --shape 2048,768,128,8 --shape 4096,4096,64,4
    run python3 -m bench.layer --tokens 32768 --peers ours,gemm,sonic --shape 2048,1024,64,8 --shape 4096,1024,128,8
    ;;
  experts)
    run python3 -m bench.layer --tokens 16384 --peers ours --shape 2048,1024,64,8 --experts 8,32,128,256
    ;;
  step)
    run python3 -m bench.model --layers 8 --micro 4 --accum 4 --warmup 2 --steps 5 --routing learned
    run python3 -m bench.model --layers 8 --micro 4 --accum 4 --warmup 2 --steps 5 --routing learned --recipe fp8_rowwise --fp8-min-dim 0
    run python3 -m bench.model --layers 8 --micro 4 --accum 4 --warmup 2 --steps 5 --routing learned --recipe fp8_rowwise --fp8-min-dim 0 --fp8-dense
    ;;
  paper)  # the largest paper-width model one H200 holds (2 layers, d=4096 E=64 h=4096 k=4): bf16 vs FP8
    run python3 -m bench.model --width paper --layers 2 --micro 4 --accum 4 --warmup 2 --steps 5 --routing learned
    run python3 -m bench.model --width paper --layers 2 --micro 4 --accum 4 --warmup 2 --steps 5 --routing learned --recipe fp8_rowwise --fp8-min-dim 0
    run python3 -m bench.model --width paper --layers 2 --micro 4 --accum 4 --warmup 2 --steps 5 --routing learned --recipe fp8_rowwise --fp8-min-dim 0 --fp8-dense
    ;;
  *)
    echo "usage: bench/h200/kernels.sh check|layer|experts|step|paper" >&2
    exit 2
    ;;
esac
exit $status
