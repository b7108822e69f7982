#!/usr/bin/env bash
# How steady the measured matmul peak is (the denominator of every "of the measured peak" ratio),
# on one H200: bench.common.matmul_peak_tflops as bench.model calls it (3 warm-up + 20 timed bf16
# 8192^3 matmuls, fresh process), against the same after 2 s of matmuls and over 200 timed ones,
# four processes each.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
for i in 1 2 3 4; do
  run python3 -c "
import time, torch
from bench.common import matmul_peak_tflops
cold = matmul_peak_tflops()
a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16); b = torch.randn_like(a)
t = time.time()
while time.time() - t < 2.0:
    a @ b
torch.cuda.synchronize()
warm = matmul_peak_tflops(iters=200)
print(f'cold {cold:.1f} TFLOP/s  warm {warm:.1f} TFLOP/s')
"
done
exit $status
